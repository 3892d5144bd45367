"""Black-box agents behind an OpenAI-compatible endpoint (``rollout.agent``, docs/agents.md).

- :mod:`~megarl.agents.loading`: the agent function a config names, checked before any model is built;
- :mod:`~megarl.agents.openai_format`: OpenAI's request and response formats, requests checked;
- :mod:`~megarl.agents.generation`: the endpoint's sampling seam over a rollout engine;
- :mod:`~megarl.agents.session`: one sample's record (segments of token ids) and the continuation rule;
- :mod:`~megarl.agents.turns`: one request: prompt ids, one model turn, recorded, the reply;
- :mod:`~megarl.agents.endpoint`: the loopback HTTP server and its sessions;
- :mod:`~megarl.agents.runner`: an agent over a batch of samples, bounded and timed;
- :mod:`~megarl.agents.trajectories`: a rollout engine's samples through the agent, as the
  trajectories the trainer trains on.
"""
