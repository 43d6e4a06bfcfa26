// Sessions and the six endpoints (docs/env-protocol.md, sections 5 and 6), independent of NATS:
// each handler takes the request's bytes and returns the reply's bytes or throws a ProtocolError.

import { Episode, TaskSet, TOOLS, ToolError, type ToolCall, type ToolResult } from "./ledger.js";
import {
  decodeRequest, encodeMessage, ProtocolError, Status,
  type EnvCancel, type EnvInteract, type EnvOracle, type EnvStart, type EnvTaskList,
} from "./protocol.js";

export type HostSettings = {
  task: string;
  replicaId: string;
  maxSessions: number;
  sessionTimeoutS: number;
  maxObservationChars: number;
};

class Session {
  turns = 0;
  invalidActions = 0;
  lastActive = Date.now();
  closed = false;
  busy = 0;
  private tail: Promise<unknown> = Promise.resolve();

  constructor(readonly id: string, readonly episode: Episode) {}

  /** Run ``fn`` after every call of this session that came before it: one at a time, in arrival order. */
  serialize<T>(fn: () => Promise<T>): Promise<T> {
    this.busy++;
    const run = this.tail.then(fn);
    this.tail = run.catch(() => undefined).finally(() => { this.busy--; });
    return run;
  }
}

/** The first tool call of an assistant message, checked against the tools' schemas; ToolError if unusable. */
export function readCall(message: Record<string, unknown>): { callId: string; call: ToolCall } {
  if (message.invalid_tool_call) throw new ToolError(`Malformed tool call: ${String(message.invalid_tool_call)}.`);
  const calls = message.tool_calls;
  if (!Array.isArray(calls) || calls.length === 0) {
    throw new ToolError("No tool call found. Reply with exactly one tool call, using one of the listed tools.");
  }
  if (calls.length > 1) throw new ToolError(`${calls.length} tool calls in one message; none was run. Call exactly one tool per turn.`);
  const fn = (calls[0] as { function?: unknown }).function as { name?: unknown; arguments?: unknown } | undefined;
  if (typeof fn !== "object" || fn === null) {
    throw new ToolError('Malformed tool call: expected {"function": {"name": ..., "arguments": ...}}.');
  }
  if (typeof fn.name !== "string" || !fn.name) throw new ToolError("Malformed tool call: missing function name.");
  let args: unknown = fn.arguments ?? "{}";
  if (typeof args === "string") {
    try {
      args = args.trim() ? JSON.parse(args) : {};
    } catch (err) {
      throw new ToolError(`Malformed tool call: arguments are not valid JSON (${(err as Error).message}).`);
    }
  }
  if (typeof args !== "object" || args === null || Array.isArray(args)) {
    throw new ToolError("Malformed tool call: arguments must be a JSON object.");
  }
  const call = { name: fn.name, arguments: args as Record<string, unknown> };
  const schema = TOOLS.find((t) => t.function.name === call.name)?.function;
  if (!schema) {
    throw new ToolError(`Unknown tool '${call.name}'. Available tools: ${TOOLS.map((t) => t.function.name).sort().join(", ")}.`);
  }
  const { properties, required } = schema.parameters;
  const missing = required.filter((p) => !(p in call.arguments));
  if (missing.length) throw new ToolError(`Tool ${call.name}: missing argument(s) ${missing.join(", ")}.`);
  const unknown = Object.keys(call.arguments).filter((a) => !(a in properties));
  if (unknown.length) throw new ToolError(`Tool ${call.name}: unexpected argument(s) ${unknown.join(", ")}.`);
  for (const [name, value] of Object.entries(call.arguments)) {
    const type = properties[name].type;
    const ok = type === "string" ? typeof value === "string"
      : type === "integer" ? typeof value === "number" && Number.isInteger(value)
      : type === "number" ? typeof value === "number" : true;
    if (!ok) throw new ToolError(`Tool ${call.name}: argument ${name} must be of type ${type}.`);
  }
  const id = (calls[0] as { id?: unknown }).id;
  return { callId: typeof id === "string" && id ? id : "call_0", call };
}

export class Host {
  readonly sessions = new Map<string, Session>();
  sessionsStarted = 0;
  stopping = false;
  private readonly startedAt = Date.now();
  private readonly replies = new Map<string, Uint8Array>();  // resent requests get their first reply
  private readonly replyCache: number;
  readonly interactMs: number[] = [];

  constructor(readonly settings: HostSettings, readonly taskSet: TaskSet) {
    this.replyCache = Math.max(256, 8 * settings.maxSessions);
  }

  private remember(key: string, reply: Uint8Array): Uint8Array {
    this.replies.set(key, reply);
    while (this.replies.size > this.replyCache) this.replies.delete(this.replies.keys().next().value as string);
    return reply;
  }

  private session(id: string): Session {
    const session = this.sessions.get(id);
    if (!session || session.closed) {
      throw new ProtocolError(404, `no open session ${id} on replica ${this.settings.replicaId}`);
    }
    return session;
  }

  private close(session: Session): void {
    session.closed = true;
    this.sessions.delete(session.id);
  }

  async start(data: Uint8Array): Promise<Uint8Array> {
    const req = decodeRequest<EnvStart>(data, "env_start");
    const cached = this.replies.get(`${req.session_id}/start`);
    if (cached) return cached;
    if (this.sessions.has(req.session_id)) throw new ProtocolError(409, `session ${req.session_id} already exists`);
    if (this.stopping) throw new ProtocolError(503, `replica ${this.settings.replicaId} is shutting down`);
    if (this.sessions.size >= this.settings.maxSessions) {
      throw new ProtocolError(503, `replica ${this.settings.replicaId} is at its limit of ${this.settings.maxSessions} sessions`);
    }
    const task = this.taskSet.get(req.task_id, req.split);
    if (!task) throw new ProtocolError(404, `unknown ${this.settings.task} task '${req.task_id}' in split '${req.split}'`);
    const episode = new Episode(task);  // the task is fixed by its id: the seed has nothing left to draw
    this.sessions.set(req.session_id, new Session(req.session_id, episode));
    this.sessionsStarted++;
    return this.remember(`${req.session_id}/start`, encodeMessage("env_started", {
      session_id: req.session_id, replica_id: this.settings.replicaId, messages: episode.opening(), tools: TOOLS,
      max_turns: episode.maxTurns, level: task.level, task_kind: task.kind }));
  }

  async interact(data: Uint8Array): Promise<Uint8Array> {
    const began = performance.now();
    const req = decodeRequest<EnvInteract>(data, "env_interact");
    const key = `${req.session_id}/turn-${req.turn}`;
    const cached = req.turn >= 0 ? this.replies.get(key) : undefined;
    if (cached) return cached;
    const session = this.session(req.session_id);
    const reply = await session.serialize(async () => {
      const again = req.turn >= 0 ? this.replies.get(key) : undefined;  // the first copy ran while this one waited
      if (again) return again;
      if (session.closed) throw new ProtocolError(404, `session ${req.session_id} was closed`);
      session.lastActive = Date.now();
      session.turns++;
      const { callId, result } = this.play(session, req.message);
      let content = this.truncate(result.content);
      let { finish, reward, status } = result;
      if (!finish && session.turns >= session.episode.maxTurns) {
        content += "\n\nTurn limit reached.";
        [finish, reward, status] = [true, 0, Status.taskLimitReached];
      }
      if (finish) this.close(session);
      session.lastActive = Date.now();
      const out = encodeMessage("env_step", {
        finish, reward, status, messages: [{ role: "tool", tool_call_id: callId, content }],
        metrics: { ...result.metrics, turns: session.turns, invalid_actions: session.invalidActions } });
      return req.turn >= 0 ? this.remember(key, out) : out;
    });
    this.interactMs.push(performance.now() - began);
    if (this.interactMs.length > 10_000) this.interactMs.shift();
    return reply;
  }

  private play(session: Session, message: Record<string, unknown>): { callId: string; result: ToolResult } {
    let callId = "call_0";
    try {
      const read = readCall(message);
      callId = read.callId;
      return { callId, result: session.episode.call(read.call) };
    } catch (err) {
      if (err instanceof ToolError) {  // the agent's mistake: an observation, the episode goes on
        session.invalidActions++;
        return { callId, result: { content: `Error: ${err.message}`, finish: false, reward: 0, status: Status.running, metrics: {} } };
      }
      return { callId, result: { content: `Environment error: ${String(err)}`, finish: true, reward: 0,
                                 status: Status.envError, metrics: {} } };
    }
  }

  private truncate(content: string): string {
    const limit = this.settings.maxObservationChars;
    if (content.length <= limit) return content;
    return `${content.slice(0, limit)}\n[truncated: ${content.length - limit} more characters not shown]`;
  }

  async oracle(data: Uint8Array): Promise<Uint8Array> {
    const req = decodeRequest<EnvOracle>(data, "env_oracle");
    const session = this.session(req.session_id);
    const call = session.episode.oracle();
    return encodeMessage("env_interact", { session_id: req.session_id, message: {
      role: "assistant", content: "", tool_calls: [{ id: `call_${session.turns}`, type: "function",
        function: { name: call.name, arguments: JSON.stringify(call.arguments) } }] } });
  }

  async cancel(data: Uint8Array): Promise<Uint8Array> {
    const req = decodeRequest<EnvCancel>(data, "env_cancel");
    const cached = this.replies.get(`${req.session_id}/cancel`);
    if (cached) return cached;
    const session = this.session(req.session_id);
    this.close(session);
    return this.remember(`${req.session_id}/cancel`, encodeMessage("env_step", {
      finish: true, reward: 0, status: Status.cancelled, messages: [], metrics: { turns: session.turns } }));
  }

  async tasks(data: Uint8Array): Promise<Uint8Array> {
    const req = decodeRequest<EnvTaskList>(data, "env_task_list");
    const ids = this.taskSet.ids(req.split);
    if (!ids) throw new ProtocolError(404, `${this.settings.task} has no split '${req.split}'`);
    return encodeMessage("env_task_list", { split: req.split, task_ids: ids });
  }

  async health(): Promise<Uint8Array> {
    const recent = [...this.interactMs].sort((a, b) => a - b);
    const at = (q: number) => (recent.length ? recent[Math.floor(q * (recent.length - 1))] : 0);
    return encodeMessage("env_health", {
      replica_id: this.settings.replicaId, task: this.settings.task, sessions: this.sessions.size,
      max_sessions: this.settings.maxSessions, sessions_started: this.sessionsStarted,
      uptime_s: (Date.now() - this.startedAt) / 1000,
      task_counts: { train: this.taskSet.ids("train")?.length ?? 0, test: this.taskSet.ids("test")?.length ?? 0 },
      interact_ms_p50: at(0.5), interact_ms_p99: at(0.99) });
  }

  /** Close the sessions nobody has called for ``sessionTimeoutS`` (status timeout; nobody is told). */
  reapIdle(): number {
    const cutoff = Date.now() - this.settings.sessionTimeoutS * 1000;
    let reaped = 0;
    for (const session of [...this.sessions.values()]) {
      if (session.lastActive < cutoff && session.busy === 0) {
        this.close(session);
        reaped++;
      }
    }
    return reaped;
  }

  /** On shutdown: refuse new starts, close every open session; returns how many were open. */
  closeAll(): number {
    this.stopping = true;
    const open = this.sessions.size;
    for (const session of [...this.sessions.values()]) this.close(session);
    return open;
  }
}
