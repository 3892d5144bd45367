"""The rollout group's side of its links with the trainers in asynchronous training: a thread
that receives their control messages (objects over a gloo bridge: host memory only) and, on the
leader, a thread that sends them its generations in the order they were made, so generating
never waits for the trainers.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from megarl.rollout.async_links import Links
from megarl.rollout.rollout_messages import Draws, Generated, Push, Start, Stop
from megarl.weights.weight_sync import PushInbox


@dataclass
class TrainerLink:
    """What the trainers told this rollout rank, and what its leader sends them. A weight push
    is only announced here (into ``inbox``): its weights are received by the generating thread
    (:class:`megarl.trainer.group_weights.GroupWeights`)."""

    links: Links
    inbox: PushInbox
    leader: bool
    outbox: queue.Queue = field(default_factory=queue.Queue)  # None ends the send thread
    _starts: queue.Queue = field(default_factory=queue.Queue)
    _verdicts: queue.Queue = field(default_factory=queue.Queue)  # dynamic sampling's Draws
    _send_error: list[BaseException] = field(default_factory=list)

    def receive_loop(self) -> None:
        """Control messages from the trainers until they stop; an error ends every wait of the
        generating thread with it."""
        try:
            assert self.links.control is not None
            while True:
                message = self.links.control.broadcast_object(src=0)
                if isinstance(message, Start):
                    self._starts.put(message)
                elif isinstance(message, Push):
                    self.inbox.add(message.version)
                elif isinstance(message, Draws):
                    self._verdicts.put(message)
                elif isinstance(message, Stop):
                    self._end(None)
                    return
        except BaseException as e:  # handed to the generating thread
            self._end(e)

    def _end(self, error: BaseException | None) -> None:
        self.inbox.close(error)
        self._starts.put(None)
        self._verdicts.put(None)

    def start(self) -> Start | None:
        """Where the trainers begin (None: they stopped, or receiving failed)."""
        return self._starts.get()

    def verdict(self) -> Draws | None:
        """Dynamic sampling's next verdict (None: the trainers stopped, or receiving failed)."""
        return self._verdicts.get()

    def send_loop(self) -> None:
        """The leader's generations to the trainers, in the order they were made."""
        assert self.links.batches is not None
        while True:
            message = self.outbox.get()
            if message is None:
                return
            try:
                self.links.batches.broadcast_object(message, src=0)
            except BaseException as e:
                self._send_error.append(e)
                return

    def send(self, message: Generated) -> None:
        """Queue ``message`` for the trainers (the leader's; the others send nothing)."""
        if self._send_error:
            raise RuntimeError("sending generations to the trainers failed") from self._send_error[
                0
            ]
        if self.leader:
            self.outbox.put(message)

    def close(self) -> None:
        """The send thread ends once everything queued is sent."""
        self.outbox.put(None)


__all__ = ["TrainerLink"]
