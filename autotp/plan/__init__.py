"""Plan: the immutable description of a sharding, how a tensor is cut, and how the plan is rendered."""
