"""The text-mode shop: WebShop's page flow (search -> results -> item -> sub page -> buy) as one small
state machine per episode, rendered the way WebShop's ``WebAgentTextEnv(observation_mode="text")``
renders pages (visible strings joined by `` [SEP] ``), driven by AgentBench's function-calling tools
``search_action(keywords)`` and ``click_action(value)``.

Differences from WebShop, on purpose:
* a click on something that is not on the page or a search with no words does nothing (as in WebShop)
  *and* says why, with the page's clickables (contract rule 5);
* search works only where the page has a search bar, as AgentBench's prompt tells the agent (WebShop's
  text env would run it from any page);
* the instruction is shown on the first page only (it is in the opening message already);
* ratings and a few short reviews are generated (WebShop's loader leaves them empty: "Rating: N.A.").
"""

from __future__ import annotations

import json
import random
from typing import Any

from services.envs.base import Episode, ToolCall, ToolError, ToolResult
from services.envs.webshop.catalog import Catalog
from services.envs.webshop.goals import reward
from shared.messages import EpisodeStatus

SEP = " [SEP] "
PRODUCT_WINDOW = 10  # WebShop: results per page
END_BUTTON, NEXT_PAGE, PREV_PAGE, BACK_TO_SEARCH = "Buy Now", "Next >", "< Prev", "Back to Search"
SUB_PAGES = ("Description", "Features", "Reviews")
MAX_ECHO_CHARS = 200  # the action echoed back is cut here, so a huge search string cannot flood the page

SYSTEM_PROMPT = """You are shopping on a web shop, following the user's instruction.
Each round you get an observation of the current page and the actions available on it, and you reply
by calling exactly one of the tools.
Use search_action when the page has a search bar (has_search_bar is True); choose your keywords well.
Use click_action with one of the values listed in clickables, written exactly as listed.
An action that is not available does nothing.
Think about what to do first, then call a tool. Always call a tool; do not ask for confirmation.
You have at most {max_turns} rounds; the episode ends when you click "buy now"."""

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search_action",
        "description": "Search the shop for products with the given keywords. Only available on the search page "
                       "(when has_search_bar is True).",
        "parameters": {"type": "object", "properties": {
            "keywords": {"type": "string", "description": "The search query, e.g. 'sulfate free shampoo'."}},
            "required": ["keywords"]}}},
    {"type": "function", "function": {
        "name": "click_action",
        "description": "Click a button, product, or option on the current page. The value must be one of the "
                       "clickables listed in Available Actions.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "string", "description": "The clickable to click, e.g. 'buy now' or 'b0abc12345'."}},
            "required": ["value"]}}},
]

REVIEW_LINES = [
    "works exactly as described.", "good value for the money.", "arrived quickly and well packed.",
    "would buy again.", "a little smaller than i expected, but fine.", "my second one, still happy with it.",
    "not bad, does the job.", "quality is better than the price suggests.",
]


def reviews(asin: str) -> list[tuple[int, str]]:
    rng = random.Random(f"webshop-reviews-{asin}")
    return [(rng.randint(2, 5), rng.choice(REVIEW_LINES)) for _ in range(rng.randint(1, 3))]


class ShopEpisode(Episode):
    """One shopper's session. ``page`` is one of search / results / item / sub / done."""

    max_turns = 20  # AgentBench's WebShop: 20 rounds
    calls_per_message = "first"  # as AgentBench's WebShop task: a message's first call

    def __init__(self, catalog: Catalog, goal: dict[str, Any], task_id: str) -> None:
        self.catalog, self.goal, self.task_id = catalog, goal, task_id
        self.page = "search"
        self.results: list[str] = []  # top-50 ASINs of the last search
        self.page_no = 1
        self.asin: str | None = None
        self.product: dict[str, Any] | None = None
        self.options: dict[str, str] = {}
        self.sub_page = ""
        self.searches = 0
        self.clicks = 0

    # ------------------------------------------------------------------ contract
    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM_PROMPT.format(max_turns=self.max_turns)},
                {"role": "user", "content": f"The initial observation:\n{self.observation()}\n\n"
                                            f"Available Actions:\n{self.available_actions()}"}]

    def call(self, tool: ToolCall) -> ToolResult:
        if tool.name == "search_action":
            action = f"search[{tool.arguments['keywords']}]"
            self.search(tool.arguments["keywords"])
        elif tool.name == "click_action":
            action = f"click[{tool.arguments['value']}]"
            done = self.click(tool.arguments["value"])
            if done is not None:
                return done
        else:
            raise ToolError(f"Unknown tool {tool.name!r}. Available tools: click_action, search_action.")
        if len(action) > MAX_ECHO_CHARS:
            action = action[:MAX_ECHO_CHARS] + "…]"
        return ToolResult(content=f"Action: {action}\n\nObservation:\n{self.observation()}\n\n"
                                  f"Available Actions:\n{self.available_actions()}")

    # ------------------------------------------------------------------ actions
    def search(self, keywords: str) -> None:
        if self.page != "search":
            raise ToolError(f"There is no search bar on this page; nothing was done. Click "
                            f"'{BACK_TO_SEARCH.lower()}' first. Clickables: {self.clickables()}")
        keywords = keywords.strip().lower()
        if not keywords:
            raise ToolError("Empty search: give one or more keywords; nothing was done.")
        self.searches += 1
        self.results = self.catalog.search(keywords)
        self.page, self.page_no, self.asin, self.product, self.options = "results", 1, None, None, {}

    def click(self, value: str) -> ToolResult | None:
        """Apply a click; returns the finishing result on Buy Now."""
        value = value.strip().lower()
        clickables = self.clickables()
        if value == "search" and self.page == "search":
            raise ToolError("To search, call search_action with your keywords; nothing was done.")
        if value not in clickables:
            raise ToolError(f"{value!r} is not clickable on this page; nothing was done. Clickables: {clickables}")
        self.clicks += 1
        if value == END_BUTTON.lower():
            return self.buy()
        if value == BACK_TO_SEARCH.lower():
            self.page, self.results, self.asin, self.product, self.options = "search", [], None, None, {}
        elif value == NEXT_PAGE.lower():
            self.page_no += 1
        elif value == PREV_PAGE.lower():
            if self.page == "results":
                self.page_no -= 1
            elif self.page == "item":
                self.page, self.asin, self.product, self.options = "results", None, None, {}
            else:
                self.page = "item"
        elif value in (s.lower() for s in SUB_PAGES):
            self.page, self.sub_page = "sub", value
        elif self.page == "results":
            self.page, self.asin, self.options = "item", value.upper(), {}
            self.product = self.catalog.product(self.asin)
            if self.product is None:  # the index and the table come from one build; this is a bug
                raise RuntimeError(f"product {self.asin} is in the results but not in the catalogue")
        else:  # an option value on the item page
            assert self.product is not None
            for name, values in self.product["options"].items():
                if value in values:
                    self.options[name] = value
                    break
        return None

    def buy(self) -> ToolResult:
        assert self.product is not None
        total, info = reward(self.product, self.goal, self.options)
        self.page = "done"
        success = float(total >= 1.0)
        content = SEP.join(["Thank you for shopping with us!", "Purchased", self.product["asin"], "Options",
                            json.dumps(self.options), "Your score (min 0.0, max 1.0)", f"{total:.4f}"])
        metrics = dict(info, success=success, searches=float(self.searches), clicks=float(self.clicks))
        return ToolResult(content=f"Action: click[buy now]\n\nObservation:\n{content}", finish=True,
                          reward=total, status=EpisodeStatus.COMPLETED, metrics=metrics)

    # ------------------------------------------------------------------ rendering
    def page_asins(self) -> list[str]:
        start = (self.page_no - 1) * PRODUCT_WINDOW
        return self.results[start:start + PRODUCT_WINDOW]

    def clickables(self) -> list[str]:
        """What WebShop's get_available_actions lists: buttons, then product links, then options."""
        if self.page == "search":
            return ["search"]
        if self.page == "results":
            buttons = [BACK_TO_SEARCH]
            if self.page_no > 1:
                buttons.append(PREV_PAGE)
            if self.page_no * PRODUCT_WINDOW < len(self.results):
                buttons.append(NEXT_PAGE)
            return [b.lower() for b in buttons] + [a.lower() for a in self.page_asins()]
        if self.page == "item":
            assert self.product is not None
            buttons = [BACK_TO_SEARCH, PREV_PAGE, *SUB_PAGES, END_BUTTON]
            return [b.lower() for b in buttons] + [v for values in self.product["options"].values() for v in values]
        if self.page == "sub":
            return [BACK_TO_SEARCH.lower(), PREV_PAGE.lower()]
        return []

    def available_actions(self) -> str:
        return repr({"has_search_bar": self.page == "search", "clickables": self.clickables()})

    def observation(self) -> str:
        if self.page == "search":
            return SEP.join(["WebShop", "Instruction:", self.goal["instruction_text"], "Search"])
        if self.page == "results":
            parts = [BACK_TO_SEARCH, f"Page {self.page_no} (Total results: {len(self.results)})"]
            if self.page_no > 1:
                parts.append(PREV_PAGE)
            if self.page_no * PRODUCT_WINDOW < len(self.results):
                parts.append(NEXT_PAGE)
            shown = self.page_asins()
            info = self.catalog.summaries(shown)
            for asin in shown:
                title, price = info[asin]
                parts += [asin, title, price]
            return SEP.join(parts)
        assert self.product is not None
        p = self.product
        if self.page == "item":
            parts = [BACK_TO_SEARCH, PREV_PAGE]
            for name, values in p["options"].items():
                parts += [name, *values]
            stars = reviews(p["asin"])
            rating = sum(s for s, _ in stars) / len(stars)
            parts += [p["title"], f"Price: {p['price_tag']}", f"Rating: {rating:.1f}", *SUB_PAGES, END_BUTTON]
            return SEP.join(parts)
        if self.sub_page == "description":
            body = [p["description"]]
        elif self.sub_page == "features":
            body = list(p["bullets"])
        else:
            body = [f"{score} out of 5 stars: {text}" for score, text in reviews(p["asin"])]
        return SEP.join([BACK_TO_SEARCH, PREV_PAGE, *body])


def oracle_call(episode: ShopEpisode) -> ToolCall:
    """The scripted expert: search the goal's key terms (then the exact title if the target did not
    come up), open the target, choose the goal's options, buy."""
    goal, target = episode.goal, episode.goal["asin"]
    if episode.page == "search":
        if episode.searches == 0:
            keywords = " ".join([*goal["attributes"], goal["type"]])
        else:
            product = episode.catalog.product(target)
            assert product is not None
            keywords = product["title"]
        return ToolCall("search_action", {"keywords": keywords})
    if episode.page == "results":
        if target in episode.page_asins():
            return ToolCall("click_action", {"value": target.lower()})
        if target in episode.results[episode.page_no * PRODUCT_WINDOW:]:
            return ToolCall("click_action", {"value": NEXT_PAGE.lower()})
        if target in episode.results:
            return ToolCall("click_action", {"value": PREV_PAGE.lower()})
        return ToolCall("click_action", {"value": BACK_TO_SEARCH.lower()})
    if episode.page == "item":
        if episode.asin != target:
            return ToolCall("click_action", {"value": PREV_PAGE.lower()})
        for name, value in goal["goal_options"].items():
            if episode.options.get(name) != value:
                return ToolCall("click_action", {"value": value})
        return ToolCall("click_action", {"value": END_BUTTON.lower()})
    return ToolCall("click_action", {"value": PREV_PAGE.lower()})
