"""A Gymnasium env written for the tests: guess a word of lowercase letters, Wordle-like feedback as text.
Text observations and a ``Text`` action space with a charset, so the adapter's space checks are exercised;
the action ``crash`` makes ``step`` raise (an env bug), which must end the episode as env_error."""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces

WORDS = ["apple", "brick", "cloud", "dance", "eagle", "flame", "grape", "house", "input", "joker"]


class WordGame(gymnasium.Env[str, str]):
    metadata = {"render_modes": []}

    def __init__(self, max_guesses: int = 6) -> None:
        self.max_guesses = max_guesses
        self.action_space = spaces.Text(min_length=1, max_length=12, charset=string.ascii_lowercase)
        self.observation_space = spaces.Text(max_length=400, charset=string.printable)
        self.word = ""
        self.guesses = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.word = WORDS[int(self.np_random.integers(len(WORDS)))]
        self.guesses = 0
        return (f"Guess the secret {len(self.word)}-letter word in {self.max_guesses} guesses. After each guess "
                "you learn which letters are right (+), in the word elsewhere (?) or absent (-)."), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "crash":
            raise RuntimeError("the word game's engine crashed")
        self.guesses += 1
        if action == self.word:
            return "Correct!", 1.0, True, False, {}
        marks = "".join("+" if i < len(self.word) and c == self.word[i] else "?" if c in self.word else "-"
                        for i, c in enumerate(action))
        if self.guesses >= self.max_guesses:
            return f"{action}: {marks}. Out of guesses; the word was {self.word}.", 0.0, True, False, {}
        return f"{action}: {marks}", 0.0, False, False, {}
