// The ledger task: a customer's basket, prices only the shop's tools know, one total in cents to give.
//
// Level 1 (kind "single"): one item bought several times. Level 2 ("basket"): two or three items.
// Level 3 ("discount"): a basket with a percentage off the whole, rounded down to a whole cent.
// Tools: get_price(item), calculate(expression), submit_answer(answer). The grade is exact: reward 1 for
// the right total, 0 otherwise. Every task is generated from its id (a seeded generator), the same on
// every replica; train and test are disjoint; the oracle solves any of them through the same tools.

export type ToolSchema = {
  type: "function";
  function: { name: string; description: string; parameters: {
    type: "object"; properties: Record<string, { type: string; description: string }>; required: string[] } };
};

/** A bad tool call or a refused argument: shown to the agent, the episode goes on. */
export class ToolError extends Error {}

export type ToolResult = { content: string; finish: boolean; reward: number; status: string;
                           metrics: Record<string, number> };

export type ToolCall = { name: string; arguments: Record<string, unknown> };

type Line = { item: string; quantity: number };

export type LedgerTask = {
  id: string;
  level: number;
  kind: string;
  prices: Record<string, number>;  // the shop's stock: the basket's items and a few others
  basket: Line[];
  discountPercent: number;
  answer: number;
};

const ITEMS = ["apple", "pear", "banana", "orange", "lemon", "mango", "peach", "plum", "cherry", "grape",
  "melon", "kiwi", "onion", "carrot", "potato", "tomato", "pepper", "garlic", "bread", "cheese", "butter",
  "milk", "rice", "flour", "sugar", "coffee", "tea", "honey", "jam", "soap"];
const KINDS = ["single", "basket", "discount"];

/** FNV-1a: a task id's seed. */
function hash(text: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h;
}

/** mulberry32: a small seeded generator, so every replica makes the same tasks. */
function generator(seed: number): (n: number) => number {
  let state = seed >>> 0;
  return (n: number) => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return Math.floor((((t ^ (t >>> 14)) >>> 0) / 4294967296) * n);
  };
}

function total(task: Pick<LedgerTask, "prices" | "basket" | "discountPercent">): number {
  const sum = task.basket.reduce((acc, line) => acc + line.quantity * task.prices[line.item], 0);
  return Math.floor((sum * (100 - task.discountPercent)) / 100);
}

function makeTask(id: string, level: number, attempt: number): LedgerTask {
  const draw = generator(hash(`${id}/${attempt}`));
  const stock = [...ITEMS];
  for (let i = stock.length - 1; i > 0; i--) {  // Fisher-Yates: the shop's items, in a random order
    const j = draw(i + 1);
    [stock[i], stock[j]] = [stock[j], stock[i]];
  }
  const shop = stock.slice(0, 6);
  const prices: Record<string, number> = {};
  for (const item of shop) prices[item] = 20 + draw(480);
  const lines = level === 1 ? 1 : 2 + draw(2);
  const basket = shop.slice(0, lines).map((item) => ({ item, quantity: 1 + draw(level === 1 ? 9 : 5) }));
  const discountPercent = level === 3 ? 5 * (1 + draw(6)) : 0;
  const task = { id, level, kind: KINDS[level - 1], prices, basket, discountPercent, answer: 0 };
  task.answer = total(task);
  return task;
}

function signature(task: LedgerTask): string {
  return JSON.stringify([task.basket, task.discountPercent, task.basket.map((l) => task.prices[l.item])]);
}

/** Both splits, generated at start-up: ``train-0000`` .. and ``test-0000`` .., levels 1, 2, 3 in turn. */
export class TaskSet {
  readonly splits = new Map<string, Map<string, LedgerTask>>();

  constructor(numTrain: number, numTest: number) {
    const seen = new Set<string>();
    for (const [split, count] of [["train", numTrain], ["test", numTest]] as const) {
      const tasks = new Map<string, LedgerTask>();
      for (let i = 0; i < count; i++) {
        const id = `${split}-${String(i).padStart(4, "0")}`;
        let task = makeTask(id, 1 + (i % 3), 0);
        for (let attempt = 1; seen.has(signature(task)); attempt++) task = makeTask(id, task.level, attempt);
        seen.add(signature(task));  // disjoint splits: no test task repeats a train task
        tasks.set(id, task);
      }
      this.splits.set(split, tasks);
    }
  }

  ids(split: string): string[] | undefined {
    const tasks = this.splits.get(split);
    return tasks && [...tasks.keys()];
  }

  get(taskId: string, split: string): LedgerTask | undefined {
    return this.splits.get(split)?.get(taskId);
  }
}

export const TOOLS: ToolSchema[] = [
  { type: "function", function: { name: "get_price", description: "The shop's price of one unit of an item, in cents.",
    parameters: { type: "object", properties: { item: { type: "string", description: "the item's name, e.g. apple" } },
                  required: ["item"] } } },
  { type: "function", function: { name: "calculate",
    description: "Evaluate an arithmetic expression: numbers, + - * / and parentheses.",
    parameters: { type: "object", properties: { expression: { type: "string", description: "e.g. 3 * 45 + 2 * 17" } },
                  required: ["expression"] } } },
  { type: "function", function: { name: "submit_answer",
    description: "Give the total the customer pays, in whole cents. This ends the task.",
    parameters: { type: "object", properties: { answer: { type: "integer", description: "the total in cents" } },
                  required: ["answer"] } } },
];

const MAX_EXPRESSION = 200;

/** A tiny recursive-descent calculator: numbers, + - * /, unary minus, parentheses; nothing else runs. */
export function calculate(expression: string): number {
  if (expression.length > MAX_EXPRESSION) throw new ToolError(`expression longer than ${MAX_EXPRESSION} characters`);
  const tokens = expression.match(/\d+(?:\.\d+)?|[-+*/()]|\S/g) ?? [];
  let at = 0;
  const peek = () => tokens[at];
  const expect = (what: string) => {
    if (tokens[at] !== what) throw new ToolError(`expected ${JSON.stringify(what)} at token ${at + 1}`);
    at++;
  };
  const atom = (): number => {
    const token = tokens[at++];
    if (token === "(") { const v = sum(); expect(")"); return v; }
    if (token === "-") return -atom();
    if (token !== undefined && /^\d/.test(token)) return Number(token);
    throw new ToolError(token === undefined ? "the expression ends too soon" : `unexpected ${JSON.stringify(token)}`);
  };
  const product = (): number => {
    let v = atom();
    while (peek() === "*" || peek() === "/") {
      const op = tokens[at++];
      const rhs = atom();
      if (op === "/" && rhs === 0) throw new ToolError("division by zero");
      v = op === "*" ? v * rhs : v / rhs;
    }
    return v;
  };
  const sum = (): number => {
    let v = product();
    while (peek() === "+" || peek() === "-") v = tokens[at++] === "+" ? v + product() : v - product();
    return v;
  };
  const value = sum();
  if (at !== tokens.length) throw new ToolError(`unexpected ${JSON.stringify(tokens[at])} at token ${at + 1}`);
  return value;
}

function formatNumber(value: number): string {
  return Number.isInteger(value) ? String(value) : String(Math.round(value * 1e6) / 1e6);
}

/** One session's episode: the task, what the agent has looked up so far. */
export class Episode {
  readonly looked: string[] = [];
  calculated = false;
  readonly maxTurns = 8;

  constructor(readonly task: LedgerTask) {}

  opening(): Array<Record<string, string>> {
    const lines = this.task.basket.map((l) => `${l.quantity} x ${l.item}`).join(", ");
    const discount = this.task.discountPercent
      ? ` A discount of ${this.task.discountPercent}% applies to the whole basket; round the total down to a whole cent.`
      : "";
    return [
      { role: "system", content: "You help a shop's cashier. Prices are in cents and only the get_price tool knows " +
        "them. Look up what you need, compute with calculate, then give the total with submit_answer." },
      { role: "user", content: `A customer buys: ${lines}.${discount} What do they pay, in cents?` },
    ];
  }

  call(tool: ToolCall): ToolResult {
    const going = (content: string): ToolResult => ({ content, finish: false, reward: 0, status: "running", metrics: {} });
    if (tool.name === "get_price") {
      const item = String(tool.arguments.item).trim().toLowerCase();
      const price = this.task.prices[item];
      if (price === undefined) {
        throw new ToolError(`the shop has no ${JSON.stringify(item)}; it sells ${Object.keys(this.task.prices).sort().join(", ")}`);
      }
      if (!this.looked.includes(item)) this.looked.push(item);
      return going(`${item}: ${price} cents each`);
    }
    if (tool.name === "calculate") {
      const value = calculate(String(tool.arguments.expression));
      this.calculated = true;
      return going(formatNumber(value));
    }
    const answer = tool.arguments.answer as number;
    const correct = answer === this.task.answer;
    return { content: correct ? `Correct: the total is ${answer} cents.` : `Wrong: ${answer} is not the total.`,
             finish: true, reward: correct ? 1 : 0, status: "completed", metrics: { correct: correct ? 1 : 0 } };
  }

  /** The scripted expert's next call: look up every item of the basket, compute, answer. */
  oracle(): ToolCall {
    const missing = this.task.basket.find((l) => !this.looked.includes(l.item));
    if (missing) return { name: "get_price", arguments: { item: missing.item } };
    if (this.task.level > 1 && !this.calculated) {
      const sum = this.task.basket.map((l) => `${l.quantity} * ${this.task.prices[l.item]}`).join(" + ");
      const expression = this.task.discountPercent ? `(${sum}) * ${100 - this.task.discountPercent} / 100` : sum;
      return { name: "calculate", arguments: { expression } };
    }
    return { name: "submit_answer", arguments: { answer: this.task.answer } };
  }
}
