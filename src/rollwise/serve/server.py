"""The OpenAI-compatible HTTP server over the native engine (FastAPI).

    server = RolloutServer(policy, engine, name="tiny")
    url = server.start()                    # uvicorn on 127.0.0.1, a free port, in a thread
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    ...
    server.publish(version)                 # new weights are in place (in-process training)
    calls = server.episodes.pop("episode-7")  # what an agent's calls under that id sampled
    server.stop()

Endpoints (docs/serve.md): /v1/models, /v1/chat/completions, /v1/completions (streaming or
not), /v1/rollouts (submit, poll, cancel a batch of episodes), /v1/episodes (calls recorded
under an episode id), /v1/generate and /v1/abort (token ids in and out, for trainers),
/tokenize, /detokenize, /v1/weights (new weights while serving), /version, /v1/stats,
/metrics, /health. Besides OpenAI's fields every choice carries
`token_ids` (the sampled ids, the stop token included) and the response `prompt_token_ids`,
so a client can keep its trajectories token for token.

Here: `RolloutServer`, the state of `state.py` (`Limits`, `ServerState`: the checks every
endpoint shares) with the FastAPI app `app.py` builds over it, run by uvicorn. Imports
`engine.base`, `serve.app` and `serve.state`.
"""

from __future__ import annotations

import socket
import threading
import time

from rollwise.engine.base import RequestEngine
from rollwise.serve.app import build_app
from rollwise.serve.state import Limits, ServerState

__all__ = ["Limits", "RolloutServer"]


class RolloutServer(ServerState):
    """`ServerState` with its HTTP app, served by uvicorn in a thread (`start`)."""

    def __init__(self, policy, engine: RequestEngine, **kw):
        """Keywords as `ServerState`: name (required), api_key, limits, source, aliases."""
        super().__init__(policy, engine, **kw)
        self.app = build_app(self)
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    # -- in-process use (tests, a trainer beside the server) -------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a background thread; returns the base URL (http://host:port)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="rollwise-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return f"http://{host}:{sock.getsockname()[1]}"

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=30)
            self._uvicorn = self._thread = None
        self.driver.stop()
