// fedge dashboard: polls the JSON API and draws SVG charts. No dependencies.
"use strict";

const COLORS = ["#2f6fed", "#e8590c", "#2b8a3e", "#ae3ec9", "#c92a2a", "#1098ad", "#5c940d", "#862e9c"];
const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

async function getJSON(path) {
  const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function el(name, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function fmt(value, digits = 4) {
  return value === null || value === undefined || Number.isNaN(value) ? "-" : Number(value).toFixed(digits);
}

function bytes(value) {
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (value >= 1000 && i < units.length - 1) { value /= 1000; i += 1; }
  return `${value.toFixed(value < 10 && i ? 1 : 0)} ${units[i]}`;
}

// A line chart: series = [{name, points: [[x, y], ...], color, axis: "left"|"right"}]
function lineChart(svg, series, { xLabel = "", yMax = null, xDigits = 1 } = {}) {
  svg.replaceChildren();
  const W = 480, H = 240, L = 40, R = 40, T = 10, B = 30;
  const all = series.flatMap((s) => s.points);
  if (!all.length) { svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no rounds yet")); return; }
  const xs = all.map((p) => p[0]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs) || 1;
  const scaleX = (x) => L + ((x - x0) / ((x1 - x0) || 1)) * (W - L - R);
  const ranges = {};
  for (const axis of ["left", "right"]) {
    const ys = series.filter((s) => (s.axis || "left") === axis).flatMap((s) => s.points.map((p) => p[1]));
    const top = axis === "left" && yMax !== null ? yMax : Math.max(...ys, 1e-9);
    ranges[axis] = { min: Math.min(0, ...ys), max: top };
  }
  const scaleY = (y, axis) => {
    const { min, max } = ranges[axis];
    return H - B - ((y - min) / ((max - min) || 1)) * (H - T - B);
  };
  svg.append(el("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#d0d5dd" }));
  svg.append(el("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#d0d5dd" }));
  for (let i = 0; i <= 4; i += 1) {
    const y = ranges.left.min + (i / 4) * (ranges.left.max - ranges.left.min);
    svg.append(el("text", { x: L - 4, y: scaleY(y, "left") + 4, "text-anchor": "end" }, fmt(y, 2)));
  }
  if (series.some((s) => s.axis === "right")) {
    for (let i = 0; i <= 4; i += 1) {
      const y = ranges.right.min + (i / 4) * (ranges.right.max - ranges.right.min);
      svg.append(el("text", { x: W - R + 4, y: scaleY(y, "right") + 4 }, fmt(y, 2)));
    }
  }
  svg.append(el("text", { x: L, y: H - 8 }, fmt(x0, 0)));
  svg.append(el("text", { x: W - R, y: H - 8, "text-anchor": "end" }, fmt(x1, x1 < 10 ? xDigits : 0)));
  svg.append(el("text", { x: (W) / 2, y: H - 8, "text-anchor": "middle" }, xLabel));
  series.forEach((s, i) => {
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${scaleX(p[0]).toFixed(1)},${scaleY(p[1], s.axis || "left").toFixed(1)}`).join(" ");
    svg.append(el("path", { d, fill: "none", stroke: s.color || COLORS[i], "stroke-width": 2 }));
    svg.append(el("text", { x: L + 8 + i * 110, y: T + 12, fill: s.color || COLORS[i] }, s.name));
  });
}

// Stacked bars: groups = [{label, values: {key: number}}]
function barChart(svg, groups, keys, { format = (v) => v } = {}) {
  svg.replaceChildren();
  const W = 480, H = 240, L = 40, T = 24, B = 30;
  if (!groups.length) { svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet")); return; }
  const totals = groups.map((g) => keys.reduce((sum, k) => sum + (g.values[k] || 0), 0));
  const top = Math.max(...totals, 1);
  const width = (W - L - 10) / groups.length;
  groups.forEach((g, i) => {
    let y = H - B;
    keys.forEach((k, j) => {
      const h = ((g.values[k] || 0) / top) * (H - T - B);
      if (h > 0) svg.append(el("rect", { x: L + i * width + 1, y: y - h, width: Math.max(width - 2, 1), height: h, fill: COLORS[j % COLORS.length] }));
      y -= h;
    });
    if (groups.length <= 12) svg.append(el("text", { x: L + i * width + width / 2, y: H - 12, "text-anchor": "middle" }, g.label));
  });
  svg.append(el("text", { x: L - 4, y: T + 4, "text-anchor": "end" }, format(top)));
  keys.forEach((k, j) => svg.append(el("text", { x: L + j * 100, y: 12, fill: COLORS[j % COLORS.length] }, k)));
}

function profilesOf(rows, field) {
  return [...new Set(rows.flatMap((r) => Object.keys(r[field] || {})))].sort();
}

function renderSummary(s) {
  document.getElementById("run-name").textContent = s.run;
  const status = document.getElementById("status");
  status.textContent = s.status;
  status.className = `badge ${s.status}`;
  document.getElementById("round-count").textContent = `${s.rounds_done} / ${s.rounds_total}`;
  const progress = document.getElementById("round-progress");
  progress.max = s.rounds_total || 1;
  progress.value = s.rounds_done;
  document.getElementById("headline-name").textContent = s.metric || "accuracy";
  document.getElementById("accuracy").textContent = fmt(s.headline);
  document.getElementById("best").textContent = s.best_headline === null || s.best_headline === undefined ? "" : `best ${fmt(s.best_headline)}`;
  document.getElementById("loss").textContent = fmt(s.loss);
  document.getElementById("sim-time").textContent = s.sim_time_s === null || s.sim_time_s === undefined ? "-" : `${fmt(s.sim_time_s, 1)} s`;
  document.getElementById("wall-time").textContent = s.wall_time_s ? `wall ${fmt(s.wall_time_s, 1)} s` : "";
  const dp = s.dp_epsilon !== null && s.dp_epsilon !== undefined;
  document.getElementById("dp-card").hidden = !dp;
  document.getElementById("dp-figure").hidden = !dp;
  if (dp) {
    document.getElementById("epsilon").textContent = fmt(s.dp_epsilon, 2);
    document.getElementById("delta").textContent = `at δ = ${s.dp_delta} (${s.dp})`;
  }
  const flags = [s.strategy, s.dataset ? null : s.task, s.dataset, s.model, s.secure_aggregation ? "secure aggregation" : null].filter(Boolean);
  document.getElementById("setup").textContent = flags.join(" · ");
}

function renderRounds(data) {
  const rows = data.rounds;
  const trained = rows.filter((r) => r.round > 0);
  const metric = rows.length ? rows[rows.length - 1].metric || "accuracy" : "accuracy";
  const scored = rows.filter((r) => r.headline !== null && r.headline !== undefined);
  const bounded = metric === "accuracy" ? { yMax: 1 } : {};
  lineChart(document.getElementById("chart-round"), [
    { name: metric, points: scored.map((r) => [r.round, r.headline]) },
    { name: "loss", points: rows.filter((r) => r.loss !== undefined).map((r) => [r.round, r.loss]), axis: "right", color: COLORS[1] },
  ], { xLabel: "round", xDigits: 0, ...bounded });
  lineChart(document.getElementById("chart-time"), [
    { name: metric, points: scored.map((r) => [r.sim_time_s, r.headline]) },
  ], { xLabel: "simulated s", ...bounded });
  const profiles = profilesOf(trained, "participants_by_profile");
  barChart(document.getElementById("chart-participants"),
    trained.slice(-40).map((r) => ({ label: String(r.round), values: r.participants_by_profile || {} })), profiles);
  const byteProfiles = profilesOf(trained, "bytes_up_by_profile");
  const sum = (field, p) => trained.reduce((t, r) => t + ((r[field] || {})[p] || 0), 0);
  barChart(document.getElementById("chart-bytes"),
    byteProfiles.map((p) => ({ label: p, values: { up: sum("bytes_up_by_profile", p), down: sum("bytes_down_by_profile", p) } })),
    ["up", "down"], { format: bytes });
  if (trained.some((r) => r.dp_epsilon !== undefined)) {
    lineChart(document.getElementById("chart-dp"), [
      { name: "ε", points: trained.map((r) => [r.round, r.dp_epsilon]) }], { xLabel: "round", xDigits: 0 });
  }
  document.getElementById("skipped").textContent = data.skipped_lines ? `· ${data.skipped_lines} unreadable line(s) skipped` : "";
}

function fillTable(id, rows, cells) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map((row) => {
    const tr = document.createElement("tr");
    for (const value of cells(row)) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.append(td);
    }
    return tr;
  }));
}

function renderDevices(data) {
  document.getElementById("device-count").textContent = `(${data.devices.length})`;
  fillTable("devices", data.devices.slice(0, 500), (d) => [d.name ? `${d.name} (${d.node})` : d.node, d.profile, d.rounds_joined, d.last_round,
    d.last_reply_s === null ? "-" : fmt(d.last_reply_s, 2), d.rejected, d.errors]);
}

function renderRejections(data) {
  fillTable("rejections", data.rejections.slice(-200).reverse(), (r) => [r.round, r.name ? `${r.name} (${r.node_id})` : r.node_id, r.reason]);
}

function renderBundle(data) {
  if (!data.bundle) return;
  const m = data.manifest || {};
  const signature = data.has_signature ? "manifest.sig present (check with fedge verify)" : "NO SIGNATURE";
  document.getElementById("bundle").textContent = `${data.bundle} · round ${m.round ?? "?"} · ${signature}`;
  document.getElementById("manifest").textContent = JSON.stringify(m, null, 2);
}

async function refresh() {
  try {
    const [summary, rounds, devices, rejections, bundle] = await Promise.all(
      ["summary", "rounds", "devices", "rejections", "bundle"].map((name) => getJSON(`/api/${name}`)));
    renderSummary(summary);
    renderRounds(rounds);
    renderDevices(devices);
    renderRejections(rejections);
    renderBundle(bundle);
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    if (summary.status === "finished") return; // nothing will change any more
  } catch (error) {
    document.getElementById("updated").textContent = `could not refresh: ${error.message}`;
  }
  setTimeout(refresh, POLL_MS);
}

// The token (off loopback) came in the URL once and now lives in a cookie: keep it out of history.
if (new URLSearchParams(window.location.search).has("token")) {
  window.history.replaceState(null, "", window.location.pathname);
}
refresh();
