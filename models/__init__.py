"""Pure-functional Flax model families. `get_family(name)` returns the family module."""
import importlib


def get_family(name: str):
    """Module with `param_path`, `is_ignored` and `build_model` for a ModelConfig.family."""
    return importlib.import_module(f"models.{name}")
