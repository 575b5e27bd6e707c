"""The error every checkpoint reader raises for a file or directory it cannot use."""


class CheckpointError(ValueError):
    """A path is not a usable checkpoint, or a checkpoint lacks what was asked of it."""
