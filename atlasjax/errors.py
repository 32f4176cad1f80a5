"""Exception types that atlasjax raises for bad input. Each names what was wrong."""


class AtlasJaxError(Exception):
    """Base class of every error atlasjax raises on purpose."""


class UnsupportedModelError(AtlasJaxError):
    """The checkpoint's architecture (or a feature of it) is not supported."""


class CheckpointError(AtlasJaxError):
    """A checkpoint is missing, truncated, corrupt, or has missing/unexpected/mis-shaped tensors."""


class InvalidRequestError(AtlasJaxError, ValueError):
    """A request or its sampling parameters are invalid (bad value, prompt too long...)."""


class EngineConfigError(AtlasJaxError, ValueError):
    """Engine configuration is inconsistent (e.g. the page pool cannot hold one sequence)."""


class QueueFullError(AtlasJaxError):
    """Too many requests are waiting; retry later (HTTP 503)."""
