"""Reward models: Bradley-Terry training on preference pairs, and scoring of sequences."""
