"""OpenEnv servers written for the tests with openenv-core's own ``create_app``, in one process:

* ``/guess``: guess a number from 1 to 100 (drawn from the reset seed; ``difficulty`` narrows or widens the
  range): the action ``{"guess": int}``, the observation says higher or lower, reward 1 and done on the
  number, done with reward 0 after ``max_guesses``; ``guess = -1`` sleeps 3 s, past the tests' step timeout;
* ``/calc``: an MCP-backed env (openenv-core's ``MCPEnvironment`` over a FastMCP server): tools ``add`` and
  ``submit``; submitting 42 is reward 1 and done;
* ``/shapes``: a union of two action types (``{"type": "circle", "radius"}`` and ``{"type": "square",
  "side"}``) whose step answers the area: the adapter's one tool per action type.

``python -m tests.servers.openenv_guess PORT``."""

from __future__ import annotations

import random
import sys
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field, TypeAdapter

RANGES = {"easy": 10, "normal": 100}


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(..., description="your guess")


class GuessObservation(Observation):
    message: str = ""


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, max_guesses: int = 7) -> None:
        super().__init__()
        self.max_guesses = max_guesses
        self.target, self.guesses, self.top = 0, 0, 100
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, difficulty: str = "normal",
              **kwargs: Any) -> GuessObservation:
        self.top = RANGES[difficulty]
        self.target = random.Random(seed).randint(1, self.top)
        self.guesses = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=f"I picked a number from 1 to {self.top}. You have {self.max_guesses} guesses.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if action.guess == -1:
            time.sleep(3)  # past the tests' step timeout
        self.guesses += 1
        self._state.step_count = self.guesses
        if action.guess == self.target:
            return GuessObservation(message="Right!", done=True, reward=1.0)
        hint = "higher" if action.guess < self.target else "lower"
        if self.guesses >= self.max_guesses:
            return GuessObservation(message=f"{hint}. No guesses left: it was {self.target}.", done=True, reward=0.0)
        return GuessObservation(message=f"{hint}.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class CircleAction(Action):
    """Area of a circle."""

    type: Literal["circle"] = "circle"
    radius: float


class SquareAction(Action):
    """Area of a square."""

    type: Literal["square"] = "square"
    side: float


ShapeAction = Annotated[CircleAction | SquareAction, Field(discriminator="type")]


class ShapesAction(Action):
    """Validates either shape (openenv-core's server validates through one class)."""

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return TypeAdapter(ShapeAction).json_schema()

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return TypeAdapter(ShapeAction).validate_python(obj)


class AreaObservation(Observation):
    area: float = 0.0


class ShapesEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> AreaObservation:
        return AreaObservation()

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> AreaObservation:
        area = 3.14159 * action.radius ** 2 if action.type == "circle" else action.side ** 2
        return AreaObservation(area=area, done=True, reward=1.0)

    @property
    def state(self) -> State:
        return State()


class CalcEnv(MCPEnvironment):
    """MCP-backed: its tools are a FastMCP server's; calling ``submit`` ends the episode, reward 1 for 42."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calc")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return "submitted"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        return GuessObservation(message="What is 40 + 2? Use the tools, then submit.")

    def _scored(self, action: Action, observation: Observation) -> Observation:
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            observation.done = True
            observation.reward = 1.0 if action.arguments.get("answer") == 42 else 0.0
        return observation

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        raise ValueError("this env takes only MCP actions")

    @property
    def state(self) -> State:
        return State()


app = FastAPI()
app.mount("/guess", create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16))
app.mount("/calc", create_app(CalcEnv, CallToolAction, CallToolObservation, env_name="calc", max_concurrent_envs=4))
app.mount("/shapes", create_app(ShapesEnv, ShapesAction, AreaObservation, env_name="shapes", max_concurrent_envs=4))

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
