"""DPO on each agent's own preference pairs (`dpo`), and decentralized DPO by gossip over a
graph (`gossip-dpo`, DecDPO). See docs/dpo.md; the math is in docs/math.md, "DPO and gossip
mixing"."""
