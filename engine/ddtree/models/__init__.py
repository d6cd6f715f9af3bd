"""Model families: reference forwards with positions, cache slots and masks; checkpoints and random weights."""
