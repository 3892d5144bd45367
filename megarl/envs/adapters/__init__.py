"""Adapters from environment libraries to :class:`megarl.envs.Environment`."""
