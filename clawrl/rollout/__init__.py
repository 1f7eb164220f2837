"""Rollout: generate functions, rewards, filters, data source and the RolloutManager."""
