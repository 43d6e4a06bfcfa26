// The JetRL env protocol (docs/env-protocol.md): subjects, the msgpack codec, coded errors.
// Everything here comes from that document, sections 3 (wire format) and 4 (subjects).

import { decode as unpack, encode as pack } from "@msgpack/msgpack";

export const MAX_MESSAGE_BYTES = 8 * 1024 * 1024;
export const PROTOCOL_VERSION = "1.0.0";

/** A refused request: answered with the micro error headers (code as text, a readable reason). */
export class ProtocolError extends Error {
  constructor(readonly code: number, readonly reason: string) {
    super(reason);
  }
}

export class Subjects {
  constructor(readonly prefix: string, readonly task: string) {}
  serviceName(): string { return `${this.prefix}-env-${this.task}`; }
  start(): string { return `${this.prefix}.env.${this.task}.start`; }
  tasks(): string { return `${this.prefix}.env.${this.task}.tasks`; }
  health(): string { return `${this.prefix}.env.${this.task}.health`; }
  interact(replica: string): string { return `${this.prefix}.env.${this.task}.${replica}.interact`; }
  cancel(replica: string): string { return `${this.prefix}.env.${this.task}.${replica}.cancel`; }
  oracle(replica: string): string { return `${this.prefix}.env.${this.task}.${replica}.oracle`; }
  registry(replica: string): string { return `$KV.${this.prefix}-registry.env.${replica}`; }  // key <role>.<replica>
  deadLetter(): string { return `${this.prefix}.dlq.env-${this.task}`; }
}

const TOKEN = /^[A-Za-z0-9_-]+$/;

export function checkToken(value: string, what: string): string {
  if (!TOKEN.test(value)) {
    throw new Error(`${what} ${JSON.stringify(value)} is not a subject token (letters, digits, _ and - only)`);
  }
  return value;
}

// ------------------------------------------------------------------------------------------ codec
type FieldType = "str" | "int" | "float" | "bool" | "map" | "list";
type Field = { type: FieldType; default?: unknown };
type Fields = Record<string, Field>;

/** The requests an env receives (docs/env-protocol.md, section 11), with their defaults. */
export const REQUESTS = {
  env_start: { session_id: { type: "str" }, task_id: { type: "str" }, split: { type: "str", default: "train" },
               seed: { type: "int", default: 0 } },
  env_interact: { session_id: { type: "str" }, message: { type: "map" }, turn: { type: "int", default: -1 } },
  env_oracle: { session_id: { type: "str" } },
  env_cancel: { session_id: { type: "str" }, reason: { type: "str", default: "cancelled" } },
  env_task_list: { split: { type: "str" }, task_ids: { type: "list", default: [] } },
} satisfies Record<string, Fields>;

export type EnvStart = { session_id: string; task_id: string; split: string; seed: number };
export type EnvInteract = { session_id: string; message: Record<string, unknown>; turn: number };
export type EnvOracle = { session_id: string };
export type EnvCancel = { session_id: string; reason: string };
export type EnvTaskList = { split: string; task_ids: string[] };

function typeName(value: unknown): string {
  if (value === null) return "nil";
  if (Array.isArray(value)) return "list";
  if (value instanceof Uint8Array) return "bytes";
  if (typeof value === "object") return "map";
  if (typeof value === "number") return Number.isInteger(value) ? "int" : "float";
  return typeof value === "string" ? "str" : typeof value;
}

function fits(value: unknown, type: FieldType): boolean {
  switch (type) {
    case "str": return typeof value === "string";
    case "int": return typeof value === "number" && Number.isInteger(value);
    case "float": return typeof value === "number";  // an integer is a float too (section 3)
    case "bool": return typeof value === "boolean";
    case "map": return typeName(value) === "map";
    case "list": return Array.isArray(value);
  }
}

/** Bytes -> the typed request ``kind``, or a ProtocolError 400 / 413 that names the field. */
export function decodeRequest<T>(data: Uint8Array, kind: keyof typeof REQUESTS): T {
  if (data.length > MAX_MESSAGE_BYTES) {
    throw new ProtocolError(413, `message is ${data.length} bytes, limit ${MAX_MESSAGE_BYTES}`);
  }
  let body: unknown;
  try {
    body = unpack(data);
  } catch (err) {
    throw new ProtocolError(400, `not msgpack: ${(err as Error).message}`);
  }
  if (typeName(body) !== "map") {
    throw new ProtocolError(400, `expected a msgpack map, got ${typeName(body)}`);
  }
  const map = body as Record<string, unknown>;
  if (map.kind !== kind) {
    throw new ProtocolError(400, `expected kind ${JSON.stringify(kind)}, got ${JSON.stringify(map.kind ?? null)}`);
  }
  const version = map.v ?? 1;
  if (typeof version !== "number" || !Number.isInteger(version) || version < 1 || version > 1) {
    throw new ProtocolError(400, `${kind}: unsupported schema version ${String(version)} (this reader knows <= 1)`);
  }
  const out: Record<string, unknown> = {};
  for (const [name, field] of Object.entries(REQUESTS[kind] as Fields)) {
    const value = map[name];
    if (value === undefined) {
      if (!("default" in field)) throw new ProtocolError(400, `${kind}: missing field ${JSON.stringify(name)}`);
      out[name] = structuredClone(field.default);
    } else if (!fits(value, field.type)) {
      throw new ProtocolError(400, `${kind}.${name}: expected ${field.type}, got ${typeName(value)}`);
    } else {
      out[name] = value;
    }
  }
  return out as T;  // fields this reader does not know are ignored (section 3)
}

/** A message as the wire wants it: ``{kind, v, ...fields}``. */
export function encodeMessage(kind: string, fields: Record<string, unknown>): Uint8Array {
  const data = pack({ kind, v: 1, ...fields });
  if (data.length > MAX_MESSAGE_BYTES) {
    throw new ProtocolError(413, `${kind} message is ${data.length} bytes, limit ${MAX_MESSAGE_BYTES}`);
  }
  return data;
}

/** Episode statuses (docs/env-protocol.md, section 11). */
export const Status = {
  running: "running",
  completed: "completed",
  taskLimitReached: "task_limit_reached",
  invalidAction: "invalid_action",
  envError: "env_error",
  cancelled: "cancelled",
  timeout: "timeout",
} as const;
