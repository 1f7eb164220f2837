"""Debugging tools: rollout and train-data dumps, replay, inspection and alignment (`clawrl debug ...`)."""
