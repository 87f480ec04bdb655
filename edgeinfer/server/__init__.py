"""The local REST API: OpenAI, Ollama and llama-server endpoints over one generation worker.

    from edgeinfer.server import ServerConfig, create_app
    app = create_app(ServerConfig(model_name="gemma3-270m"))   # /health answers 503
    app.state.server.set_model(edgeinfer.load("gemma3-270m"))  # now 200, endpoints serve

`edgeinfer serve NAME` (edgeinfer/commands/serve.py) does this with uvicorn.
"""

from edgeinfer.server.app import create_app
from edgeinfer.server.state import ServerConfig

__all__ = ["ServerConfig", "create_app"]
