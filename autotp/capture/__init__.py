"""Capture: the user's call as a graph (torch.export), flat inputs and outputs, model files."""
