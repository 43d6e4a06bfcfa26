"""OpenEnv's wire protocol, client side, as openenv-core's server speaks it (``openenv.core.env_server``):

* ``GET /schema`` -> ``{"action": <JSON schema>, "observation": ..., "state": ...}``; ``GET /health``;
* WebSocket ``/ws``: one connection is one session with an env of its own; messages ``{"type": "reset",
  "data": {seed, ...}}``, ``{"type": "step", "data": <action>}``, ``{"type": "close"}``; answers
  ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`` or ``{"type": "error",
  "data": {"message", "code"}}``;
* HTTP ``POST /reset`` (the reset arguments) and ``POST /step`` (``{"action": ...}``) answer the same
  ``{"observation", "reward", "done"}``, with whatever state the server keeps between requests.

Synchronous on purpose: the env host runs an episode's calls on its worker threads. Every wait is bounded:
a server that dies closes the socket (``ServerGone``), one that hangs runs into the timeout (``TimeoutError``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from services.envs.base import ToolError

CLIENT_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR", "INVALID_JSON", "UNKNOWN_TYPE")
"""Codes of a ``type: error`` answer that are about the action (the agent's to see); the others (capacity,
factory, session) are about the server."""


class ServerGone(RuntimeError):
    """The OpenEnv server closed the session or stopped answering: the episode ends as env_error."""


@dataclass
class StepOutcome:
    observation: dict[str, Any]
    reward: float | None
    done: bool


def outcome(data: dict[str, Any]) -> StepOutcome:
    reward = data.get("reward")
    return StepOutcome(observation=dict(data.get("observation") or {}),
                       reward=None if reward is None else float(reward), done=bool(data.get("done")))


def error_text(data: dict[str, Any]) -> str:
    """An error answer's message, its validation errors and its code."""
    text = str(data.get("message", "unknown error"))
    if data.get("errors"):
        text += ": " + "; ".join(f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg')}" for e in data["errors"])
    return f"{text} ({data.get('code', 'no code')})"


def get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


class WebSocketSession:
    def __init__(self, base_url: str, timeout_s: float) -> None:
        from websockets.sync.client import connect

        self.timeout_s = timeout_s
        ws_url = "ws" + base_url.rstrip("/").removeprefix("http") + "/ws"
        try:
            # entered as a context manager, the one form every websockets release takes without a warning;
            # close() leaves it
            self.ws = connect(ws_url, open_timeout=timeout_s, close_timeout=1.0, max_size=16 * 2**20).__enter__()
        except Exception as exc:
            raise ServerGone(f"cannot open a WebSocket session at {ws_url}: {exc}") from exc

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(json.dumps(message))
            raw = self.ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the OpenEnv server did not answer a {message['type']} within "
                               f"{self.timeout_s:g}s") from None
        except (ConnectionClosed, OSError) as exc:
            said = self._last_words()  # a server that refuses a session says why, then closes it
            raise ServerGone(f"the OpenEnv server closed the session ({said or exc})") from None
        answer = json.loads(raw)
        if answer.get("type") == "error":
            data = answer.get("data") or {}
            if data.get("code") in CLIENT_ERRORS:
                raise ToolError(f"The environment refused the action: {error_text(data)}")
            raise ServerGone(f"the OpenEnv server failed the session: {error_text(data)}")
        return dict(answer.get("data") or {})

    def _last_words(self) -> str:
        try:
            answer = json.loads(self.ws.recv(timeout=0.5))
        except Exception:  # nothing was said before the close
            return ""
        return error_text(answer.get("data") or {}) if answer.get("type") == "error" else ""

    def reset(self, kwargs: dict[str, Any]) -> StepOutcome:
        return outcome(self._ask({"type": "reset", "data": kwargs}))

    def step(self, action: dict[str, Any]) -> StepOutcome:
        return outcome(self._ask({"type": "step", "data": action}))

    def close(self) -> None:
        try:
            self.ws.send(json.dumps({"type": "close"}))
        except Exception:  # already gone: nothing to end
            pass
        self.ws.close()


class HttpSession:
    """``/reset`` and ``/step`` over plain HTTP: the server's own state (openenv-core's server makes a fresh
    env for every request; older and other servers keep one)."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code in (400, 422):
                raise ToolError(f"The environment refused the action: {detail}") from None
            raise ServerGone(f"the OpenEnv server answered {path} with {exc.code}: {detail}") from None
        except TimeoutError:
            raise TimeoutError(f"the OpenEnv server did not answer {path} within {self.timeout_s:g}s") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerGone(f"the OpenEnv server is gone ({exc})") from None

    def reset(self, kwargs: dict[str, Any]) -> StepOutcome:
        return outcome(self._post("/reset", kwargs))

    def step(self, action: dict[str, Any]) -> StepOutcome:
        return outcome(self._post("/step", {"action": action}))

    def close(self) -> None:
        """Nothing is held between requests."""


def offers_websocket(base_url: str, timeout_s: float) -> bool:
    """Whether the server takes a WebSocket session at /ws (opened and closed at once)."""
    try:
        WebSocketSession(base_url, timeout_s).close()
    except ServerGone:
        return False
    return True
