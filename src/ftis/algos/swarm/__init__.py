"""Swarm: F-TIS among peers that join, leave and rejoin, on hivemind's DHT (docs/swarm.md)."""
