"""edgeinfer: local LLM inference."""
__version__ = "0.1.0"


def load(*args, **kwargs):
    """Load a model by alias, hf.co reference or path; see `edgeinfer.api.load`."""
    from edgeinfer.api import load as _load

    return _load(*args, **kwargs)
