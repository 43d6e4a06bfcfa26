// JetRL dashboard and trajectory viewer: vanilla JS, charts drawn as inline SVG, data from the
// controller's JSON endpoints (/api/dashboard polled every 2 s, /api/episodes, server-sent events
// from /api/episodes/<id>/follow for a running episode). Served by services/controller/dashboard.py.
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
const SVG_NS = "http://www.w3.org/2000/svg";
let pollTimer = null;
let liveSource = null;
let lastEpisodeList = "";

// ------------------------------------------------------------------ small DOM helpers
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") el.className = v;
    else if (k === "style") el.style.cssText = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v);
  }
  for (const c of children.flat()) el.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return el;
}
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}
function fmt(v, digits = 3) {
  if (v == null || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return v.toFixed(0);
  return Number(v.toPrecision(digits)).toString();
}
function age(seconds) {
  if (seconds == null) return "–";
  return seconds < 60 ? seconds.toFixed(1) + " s" : (seconds / 60).toFixed(1) + " min";
}
function colorOf(key, index) {
  if (index != null) return PALETTE[index % PALETTE.length];
  let hash = 0;
  for (const ch of String(key)) hash = (hash * 31 + ch.charCodeAt(0)) >>> 0;
  return PALETTE[hash % PALETTE.length];
}
function table(headers, rows, opts = {}) {
  if (!rows.length) return h("div", { class: "empty" }, opts.empty || "nothing yet");
  const numeric = opts.numeric || [];
  return h("table", { class: opts.class || "" },
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.map((r, i) => {
      const tr = h("tr", opts.onclick ? { class: "clickable", onclick: () => opts.onclick(i) } : {},
        r.map((c, j) => h("td", numeric.includes(j) ? { class: "num" } : {}, c)));
      if (opts.rowAttrs) for (const [k, v] of Object.entries(opts.rowAttrs(i))) tr.setAttribute(k, v);
      return tr;
    })));
}

// ------------------------------------------------------------------ charts (inline SVG)
const W = 420, H = 190, M = { l: 44, r: 10, t: 10, b: 30 };

function ticks(lo, hi, n = 4) {
  if (hi === lo) return [lo];
  const step = (hi - lo) / n;
  return Array.from({ length: n + 1 }, (_, i) => lo + i * step);
}

// series: [{name, color, points: [[x, y], ...]}]
function lineChart(el, series, opts = {}) {
  el.replaceChildren();
  const pts = series.flatMap((x) => x.points);
  el.dataset.points = String(pts.length);
  if (!pts.length) { el.append(h("div", { class: "empty" }, opts.empty || "no data yet")); return; }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [opts.yMin ?? Math.min(0, ...pts.map((p) => p[1])), opts.yMax ?? Math.max(...pts.map((p) => p[1]))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) y1 = y0 + 1;
  const X = (x) => M.l + ((x - x0) / (x1 - x0)) * (W - M.l - M.r);
  const Y = (y) => H - M.b - ((y - y0) / (y1 - y0)) * (H - M.t - M.b);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  for (const t of ticks(y0, y1)) {
    svg.append(s("line", { class: "grid-line", x1: M.l, x2: W - M.r, y1: Y(t), y2: Y(t) }));
    svg.append(s("text", { x: M.l - 4, y: Y(t) + 3, "text-anchor": "end" }, opts.yFmt ? opts.yFmt(t) : fmt(t, 2)));
  }
  const stepAxis = !opts.xLabel || opts.xLabel === "step";  // training steps: whole numbers only
  const xTicks = stepAxis ? [...new Set(ticks(x0, x1).map(Math.round))].filter((t) => t >= x0 && t <= x1) : ticks(x0, x1);
  for (const t of xTicks) {
    svg.append(s("text", { x: X(t), y: H - M.b + 13, "text-anchor": "middle" }, opts.xFmt ? opts.xFmt(t) : fmt(t, 3)));
  }
  svg.append(s("line", { class: "axis", x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }));
  svg.append(s("line", { class: "axis", x1: M.l, x2: M.l, y1: M.t, y2: H - M.b }));
  svg.append(s("text", { x: (M.l + W - M.r) / 2, y: H - 4, "text-anchor": "middle" }, opts.xLabel || "step"));
  series.forEach((ser, i) => {
    const color = ser.color || colorOf(ser.name, i);
    const line = ser.points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
    svg.append(s("polyline", { points: line, fill: "none", stroke: color, "stroke-width": 2, "data-series": ser.name }));
    if (ser.points.length <= 60) for (const p of ser.points) {
      svg.append(s("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color }, s("title", {}, `${ser.name}: ${fmt(p[1])} at ${fmt(p[0])}`)));
    }
    const last = ser.points[ser.points.length - 1];
    svg.append(s("text", { x: W - M.r - 2, y: M.t + 10 + 12 * i, "text-anchor": "end", fill: color, style: `fill:${color}`,
      class: "legend" }, `${ser.name} ${fmt(last[1])}`));
  });
  el.append(svg);
}

function barChart(el, labels, values, opts = {}) {
  el.replaceChildren();
  const total = values.reduce((a, b) => a + b, 0);
  el.dataset.points = String(total);
  if (!total) { el.append(h("div", { class: "empty" }, opts.empty || "no data yet")); return; }
  const vmax = Math.max(...values);
  const bw = (W - M.l - M.r) / values.length;
  const Y = (v) => H - M.b - (v / vmax) * (H - M.t - M.b - 12);
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  values.forEach((v, i) => {
    const x = M.l + i * bw;
    svg.append(s("rect", { x: x + 2, y: Y(v), width: bw - 4, height: H - M.b - Y(v), fill: opts.color || "#5b7bd5" },
      s("title", {}, `${labels[i]}: ${v}`)));
    if (v) svg.append(s("text", { x: x + bw / 2, y: Y(v) - 3, "text-anchor": "middle" }, String(v)));
    svg.append(s("text", { x: x + bw / 2, y: H - M.b + 13, "text-anchor": "middle" }, labels[i]));
  });
  svg.append(s("line", { class: "axis", x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }));
  svg.append(s("text", { x: (M.l + W - M.r) / 2, y: H - 4, "text-anchor": "middle" }, opts.xLabel || ""));
  el.append(svg);
}

function sparkbars(values) {
  const vmax = Math.max(1, ...values);
  return h("span", { class: "sparkbars", title: values.join(" ") },
    values.map((v) => h("span", { style: `height:${Math.max(1, (24 * v) / vmax)}px` })));
}

// ------------------------------------------------------------------ dashboard
// with a status-API token (controller.http_token) the page is opened as /dashboard?token=...: pass it on
const TOKEN = new URLSearchParams(location.search).get("token");
function withToken(url) {
  if (!TOKEN) return url;
  return url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN);
}

async function getJSON(url) {
  const resp = await fetch(withToken(url), { cache: "no-store" });
  if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
  return resp.json();
}

function taskSeries(d, metric) {
  return d.tasks.map((t, i) => ({ name: t, color: colorOf(t, i), points: d.series[`task/${t}/${metric}`] || [] }))
    .filter((x) => x.points.length);
}

// the run's state in its pill: red with the reason when the run failed, amber while it waits or cannot be read
function showState(state) {
  const pill = document.getElementById("run-state");
  const kind = /^(failed|unreachable)/.test(state) ? "bad" : /^(waiting|starting)/.test(state) ? "wait"
    : state === "finished" ? "done" : "ok";
  pill.textContent = state;
  pill.title = state;
  pill.className = `pill pill-${kind}`;
  pill.dataset.state = state.split(":")[0];
  const problem = document.getElementById("run-problem");  // the whole reason, where the pill may cut it
  problem.hidden = kind !== "bad";
  problem.textContent = kind === "bad" ? (state.startsWith("failed") ? "The run failed: " + state.slice(8) : state) : "";
}

// an env replica still building its task data says how far it is ("building, questions 43 %")
function replicaNote(r) {
  const info = r.info || {};
  if (info.state === "building") {
    return "building" + (info.build ? ", " + info.build : "") + (info.percent != null ? ` ${Math.round(info.percent)} %` : "");
  }
  return info.engine_id ? `${info.engine_id} (${info.engine || "?"}, ${info.kind || "current"})` : "";
}

function renderDashboard(d) {
  const st = d.status;
  showState(st.state);
  document.getElementById("run-version").textContent = `policy v${st.policy_version} / ${st.target_steps} steps`;
  document.getElementById("run-uptime").textContent = `up ${age(st.uptime_s)}`;
  const rate = d.rates.length ? d.rates[d.rates.length - 1] : { episodes_per_s: 0, tokens_per_s: 0 };
  const cards = [
    ["episodes finished", st.episodes_finished], ["in flight", st.episodes_inflight], ["running now", d.live_episodes],
    ["episodes/s", fmt(rate.episodes_per_s)], ["tokens/s", fmt(rate.tokens_per_s)],
    ["trainer busy", fmt(100 * d.busy_overall, 3) + " %"], ["lost", st.episodes_lost],
    ["dead letters", Object.values(d.dlq).reduce((a, b) => a + b, 0)],
  ];
  const planned = Object.values(st.eval_planned || {}).reduce((a, b) => a + b, 0);
  if (planned) cards.unshift(["eval episodes done", `${st.episodes_finished} / ${planned}`]);
  const tasks = Object.entries(st.tasks);
  document.getElementById("table-tasks").replaceChildren(table(
    ["task", "published", "finished", "success", "recent success", "mean reward"],
    tasks.map(([t, x]) => [t, x.published, x.finished, fmt(x.success_rate), fmt(x.recent_success_rate), fmt(x.mean_reward)]),
    { numeric: [1, 2, 3, 4, 5], class: "tasks", empty: "no episodes published yet" }));
  renderSampler(st.sampler);
  document.getElementById("cards").replaceChildren(...cards.map(([k, v]) =>
    h("div", { class: "card", "data-key": k }, h("div", { class: "v" }, v), h("div", { class: "k" }, k))));

  lineChart(document.getElementById("chart-success"), taskSeries(d, "success"), { yMin: 0, yMax: 1 });
  lineChart(document.getElementById("chart-reward"), taskSeries(d, "reward"), {});
  const t0 = d.rates.length ? d.rates[0].ts : 0;
  const tFmt = (x) => fmt(x, 3) + "s";
  lineChart(document.getElementById("chart-episodes-rate"),
    [{ name: "episodes/s", points: d.rates.map((r) => [r.ts - t0, r.episodes_per_s]) }], { xLabel: "seconds", xFmt: tFmt });
  lineChart(document.getElementById("chart-tokens-rate"),
    [{ name: "tokens/s", color: PALETTE[2], points: d.rates.map((r) => [r.ts - t0, r.tokens_per_s]) }], { xLabel: "seconds", xFmt: tFmt });
  lineChart(document.getElementById("chart-step-time"), [{ name: "step s", color: PALETTE[3], points: d.series["train/step_s"] || [] }], {});
  lineChart(document.getElementById("chart-busy"), [{ name: "busy", color: PALETTE[4], points: d.busy }], { yMin: 0, yMax: 1 });
  barChart(document.getElementById("chart-staleness"), d.staleness.bins, d.staleness.trained, { xLabel: "versions behind" });
  barChart(document.getElementById("chart-staleness-arrival"), d.staleness.bins, d.staleness.arrival, { xLabel: "versions behind" });

  const inv = Object.entries(d.invalid_tool_calls);
  document.getElementById("table-invalid").replaceChildren(table(["task", "turns", "invalid", "rate", "recent 200"],
    inv.map(([t, x]) => [t, x.turns, fmt(x.invalid), fmt(x.rate), fmt(x.recent_rate)]), { numeric: [1, 2, 3, 4], class: "invalid" }));
  const adv = Object.entries(d.advantages);
  document.getElementById("table-advantages").replaceChildren(table(
    ["task", "step", "raw mean", "raw std", "normalised histogram"],
    adv.map(([t, a]) => [t, a.step, fmt(a.mean_raw), fmt(a.std_raw), sparkbars(a.hist)]),
    { numeric: [1, 2, 3], empty: "no RL step yet (or every group all-success / all-failure)" }));
  document.getElementById("table-replicas").replaceChildren(table(
    ["role", "replica", "host", "heartbeat age", "policy version", "engine"],
    d.replicas.map((r) => [r.role, r.replica_id, r.host, age(r.age_s), r.policy_version ?? "–",
      replicaNote(r)]),
    { numeric: [3, 4], class: "replicas", rowAttrs: (i) => ({ "data-role": d.replicas[i].role }) }));
  const dlq = Object.entries(d.dlq);
  document.getElementById("table-dlq").replaceChildren(table(["service", "dead letters"], dlq, { numeric: [1], empty: "none" }));
  document.getElementById("updated").textContent = "updated " + new Date(d.server_time * 1000).toLocaleTimeString();
}

function renderSampler(sampler) {
  // null: the configured mix alone (controller.task_sampler = "mix")
  document.getElementById("sampler").hidden = !sampler;
  if (!sampler) return;
  const rows = [];
  for (const [t, x] of Object.entries(sampler.tasks)) {
    rows.push([t, "", fmt(x.configured), fmt(x.weight), x.episodes, fmt(x.success), fmt(x.learnability)]);
    for (const [level, l] of Object.entries(x.levels)) {
      rows.push([t, level, "", "", l.episodes, fmt(l.success), fmt(l.learnability)]);
    }
  }
  document.getElementById("table-sampler").replaceChildren(table(
    ["task", "level", "configured", "weight", `episodes (last ${sampler.window})`, "success p", "p(1-p)"],
    rows, { numeric: [2, 3, 4, 5, 6], class: "sampler" }));
}

async function refreshDashboard() {
  try {
    renderDashboard(await getJSON("/api/dashboard"));
  } catch (err) {
    showState("unreachable: " + err.message);
  }
}

// ------------------------------------------------------------------ trajectory viewer
async function refreshEpisodes() {
  const form = document.getElementById("episode-filter");
  const params = new URLSearchParams();
  for (const [k, v] of new FormData(form)) if (v !== "") params.set(k, v);
  const d = await getJSON("/api/episodes?" + params);
  const key = params.toString() + JSON.stringify(d);
  if (key === lastEpisodeList) return;  // unchanged: keep the rows (and whatever the pointer is on)
  lastEpisodeList = key;
  for (const [name, values] of [["task", d.tasks], ["status", ["running", ...d.statuses]]]) {
    const sel = form.elements[name];
    const have = new Set([...sel.options].map((o) => o.value));
    for (const v of values) if (!have.has(v)) sel.append(h("option", {}, v));
  }
  document.getElementById("episode-count").textContent = `${d.episodes.length} shown`;
  document.getElementById("episode-list").replaceChildren(table(
    ["episode", "task", "task id", "split", "status", "reward", "turns", "policy versions", "engines"],
    d.episodes.map((e) => [e.episode_id, e.task, e.task_id, e.split, h("span", { class: "status-" + e.status }, e.status),
      e.reward == null ? "–" : fmt(e.reward), e.turns,
      e.min_version === e.max_version ? `v${e.min_version}` : `v${e.min_version}–v${e.max_version}`,
      h("span", {}, e.engines.map((x) => h("span", { class: "badge", style: `background:${colorOf(x)}` }, x)))]),
    { numeric: [5, 6], class: "episodes", empty: "no episodes match",
      onclick: (i) => { location.hash = "#/episode/" + encodeURIComponent(d.episodes[i].episode_id); },
      rowAttrs: (i) => ({ "data-episode": d.episodes[i].episode_id }) }));
}

function toolCallText(action) {
  const calls = (action && action.tool_calls) || [];
  return calls.map((c) => `${c.function.name}(${typeof c.function.arguments === "string" ? c.function.arguments
    : JSON.stringify(c.function.arguments)})`).join("\n");
}

function turnElement(turn) {
  const color = colorOf(turn.engine_id || "?");
  const obs = (turn.observation || []).map((m) => `[${m.role}${m.name ? " " + m.name : ""}] ${m.content ?? ""}`).join("\n\n");
  const call = toolCallText(turn.action);
  return h("div", { class: "turn", style: `border-left-color:${color}`, "data-turn": turn.turn, "data-engine": turn.engine_id || "" },
    h("h3", {}, `turn ${turn.turn} `,
      h("span", { class: "badge", style: `background:${color}` }, turn.engine_id || "?"),
      ` policy v${turn.policy_version ?? "?"}`,
      turn.reward != null ? `  ·  reward ${fmt(turn.reward)}  ·  ${turn.status}${turn.finish ? " (final)" : ""}` : "  ·  waiting for the env"),
    h("div", { class: "label" }, "assistant"),
    h("pre", { class: "assistant" }, (turn.action && turn.action.content) || "(no text)"),
    call ? [h("div", { class: "label" }, "tool call"), h("pre", { class: "tool-call" }, call)] : [],
    turn.observation ? [h("div", { class: "label" }, "observation"), h("pre", { class: "observation" }, obs)] : []);
}

function renderEpisode(d) {
  document.getElementById("episode-title").textContent = `${d.episode_id} (${d.task})${d.running ? " — running, following live" : ""}`;
  const sm = d.summary;
  document.getElementById("episode-summary").replaceChildren(sm ? table(
    ["task id", "split", "status", "reward", "turns", "tokens (generated)", "policy versions", "replica"],
    [[sm.task_id, sm.split, sm.status, fmt(sm.reward), sm.turns, `${sm.tokens} (${sm.generated_tokens})`,
      `v${sm.min_version}–v${sm.max_version}`, sm.replica_id]], { numeric: [3, 4] }) : h("div", { class: "muted" }, "not finished yet"));
  document.getElementById("episode-opening").hidden = !(d.opening && d.opening.length);
  document.getElementById("episode-opening-messages").replaceChildren(...(d.opening || []).map((m) =>
    h("div", {}, h("div", { class: "label" }, m.role), h("pre", { class: "opening" }, m.content ?? ""))));
  const engines = [...new Set(d.turns.map((t) => t.engine_id).filter(Boolean))];
  document.getElementById("engine-legend").replaceChildren(h("span", { class: "label" }, "engines: "),
    ...engines.map((e) => h("span", { class: "badge", style: `background:${colorOf(e)}` }, e)));
  document.getElementById("episode-turns").replaceChildren(...d.turns.map(turnElement));
}

async function openEpisode(id) {
  const d = await getJSON("/api/episodes/" + encodeURIComponent(id));
  renderEpisode(d);
  if (d.running) followEpisode(id, d);
}

function followEpisode(id, d) {
  if (liveSource) liveSource.close();
  const byTurn = new Map(d.turns.map((t) => [t.turn, t]));
  liveSource = new EventSource(withToken(`/api/episodes/${encodeURIComponent(id)}/follow`));
  liveSource.addEventListener("turn", (ev) => {
    const x = JSON.parse(ev.data);
    if (x.opening) { d.opening = x.opening; delete x.opening; }
    byTurn.set(x.turn, Object.assign(byTurn.get(x.turn) || {}, x));
    d.turns = [...byTurn.values()].sort((a, b) => a.turn - b.turn);
    renderEpisode(d);
  });
  liveSource.addEventListener("end", async () => {
    liveSource.close();
    liveSource = null;
    setTimeout(() => openEpisode(id), 1000);  // the finished trajectory's summary arrives just after
  });
}

// ------------------------------------------------------------------ routing
function route() {
  const hash = location.hash || "#/dashboard";
  if (pollTimer) { clearInterval(pollTimer); pollTimer = null; }
  if (liveSource && !hash.startsWith("#/episode/")) { liveSource.close(); liveSource = null; }
  const views = { dashboard: "view-dashboard", episodes: "view-episodes", episode: "view-episode" };
  const name = hash.startsWith("#/episode/") ? "episode" : hash === "#/episodes" ? "episodes" : "dashboard";
  for (const [k, id] of Object.entries(views)) document.getElementById(id).hidden = k !== name;
  document.getElementById("nav-dashboard").classList.toggle("active", name === "dashboard");
  document.getElementById("nav-episodes").classList.toggle("active", name !== "dashboard");
  if (name === "dashboard") {
    refreshDashboard();
    pollTimer = setInterval(refreshDashboard, 2000);
  } else if (name === "episodes") {
    lastEpisodeList = "";
    refreshEpisodes();
    pollTimer = setInterval(refreshEpisodes, 5000);
  } else {
    openEpisode(decodeURIComponent(hash.slice("#/episode/".length))).catch((err) => {
      document.getElementById("episode-title").textContent = err.message;
    });
  }
}

document.getElementById("episode-filter").addEventListener("submit", (ev) => { ev.preventDefault(); refreshEpisodes(); });
window.addEventListener("hashchange", route);
route();
