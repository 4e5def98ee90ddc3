// ellm inspect: the page's logic. No framework, no build step: plain DOM calls against
// the JSON API of inspect/app.py.
"use strict";

const $ = (id) => document.getElementById(id);
let current = null;        // the last /api/trace answer
let selected = null;       // {layer, pos}

function show(text) { $("status").textContent = text; }

function visible(piece) {
  // whitespace and control characters made visible in the grid
  return piece.replace(/\n/g, "\u21b5").replace(/ /g, "\u00b7") || "\u2205";
}

async function api(path, body) {
  const opts = body === undefined ? {} :
    { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const r = await fetch(path, opts);
  const data = await r.json();
  if (!r.ok) throw new Error(data.error || r.statusText);
  return data;
}

async function runTrace(body) {
  show("tracing\u2026");
  $("run").disabled = true;
  $("step").disabled = true;
  try {
    const t0 = performance.now();
    current = await api("/api/trace", body);
    // an attention map belongs to the trace it came from: clear it
    $("attn-matrix").textContent = "";
    $("attn-title").textContent = "";
    drawGrid();
    drawNext();
    show(`${current.ids.length} tokens, ${current.layers} layers, ${Math.round(performance.now() - t0)} ms`);
    const last = current.ids.length - 1;
    selectCell(selected && selected.layer < current.layers ? selected.layer : current.layers - 1, last);
  } catch (e) {
    show("error: " + e.message);
  } finally {
    $("run").disabled = false;
    $("step").disabled = current === null;
  }
}

function shade(norm, lo, hi) {
  const t = hi > lo ? (Math.log(norm) - lo) / (hi - lo) : 0.5;
  const light = 96 - Math.round(t * 46);
  return `hsl(215, 70%, ${light}%)`;
}

function drawGrid() {
  const grid = $("grid");
  grid.textContent = "";
  const head = grid.insertRow();
  const corner = document.createElement("th");
  corner.textContent = "layer";
  head.appendChild(corner);
  current.tokens.forEach((tok, pos) => {
    const th = document.createElement("th");
    th.className = "token";
    th.textContent = visible(tok);
    th.title = `position ${pos}, id ${current.ids[pos]}`;
    head.appendChild(th);
  });
  const logs = current.norms.flat().filter((n) => n > 0).map(Math.log);
  const lo = Math.min(...logs), hi = Math.max(...logs);
  for (let layer = 0; layer < current.layers; layer++) {
    const row = grid.insertRow();
    row.className = "layer-row";
    const th = document.createElement("th");
    th.className = "layer";
    th.textContent = layer;
    row.appendChild(th);
    current.tokens.forEach((_, pos) => {
      const td = row.insertCell();
      const top = current.lens[layer][pos][0];
      const norm = current.norms[layer][pos];
      td.className = "cell";
      td.dataset.layer = layer;
      td.dataset.pos = pos;
      td.textContent = visible(top.token);
      td.title = `layer ${layer}, position ${pos}\nlens: ${JSON.stringify(top.token)} p=${top.p}\n|residual| = ${norm}`;
      td.style.background = shade(norm, lo, hi);
      td.addEventListener("click", () => selectCell(layer, pos));
    });
  }
}

function drawNext() {
  const list = $("next");
  list.textContent = "";
  for (const cand of current.next) {
    const li = document.createElement("li");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.max(1, Math.round(cand.p * 200))}px`;
    li.appendChild(bar);
    li.appendChild(document.createTextNode(`${JSON.stringify(cand.token)}  ${(cand.p * 100).toFixed(2)}%`));
    li.title = "append this token and run again";
    li.dataset.id = cand.id;
    li.addEventListener("click", () => runTrace({ ids: current.ids.concat([cand.id]) }));
    list.appendChild(li);
  }
}

function selectCell(layer, pos) {
  selected = { layer, pos };
  document.querySelectorAll("#grid td.selected").forEach((td) => td.classList.remove("selected"));
  const td = document.querySelector(`#grid td[data-layer="${layer}"][data-pos="${pos}"]`);
  if (td) td.classList.add("selected");
  $("cell-title").textContent = `layer ${layer}, token ${pos} ${JSON.stringify(current.tokens[pos])}`;
  const list = $("cell-lens");
  list.textContent = "";
  for (const cand of current.lens[layer][pos]) {
    const li = document.createElement("li");
    li.textContent = `${JSON.stringify(cand.token)}  ${(cand.p * 100).toFixed(2)}%`;
    list.appendChild(li);
  }
  const heads = $("heads");
  heads.textContent = "";
  for (let h = 0; h < current.heads; h++) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "head";
    b.dataset.head = h;
    b.textContent = `head ${h}`;
    b.addEventListener("click", () => showAttention(layer, h, b));
    heads.appendChild(b);
  }
}

async function showAttention(layer, head, button) {
  document.querySelectorAll("#heads button").forEach((b) => b.classList.remove("active"));
  button.classList.add("active");
  try {
    const a = await api(`/api/attention?trace=${current.trace}&layer=${layer}&head=${head}`);
    drawAttention(a);
  } catch (e) {
    show("error: " + e.message);
  }
}

function drawAttention(a) {
  $("attn-title").textContent = `layer ${a.layer}, head ${a.head}`;
  const table = $("attn-matrix");
  table.textContent = "";
  a.matrix.forEach((row, q) => {
    const tr = table.insertRow();
    tr.className = "attn-row";
    const th = document.createElement("th");
    th.textContent = visible(a.tokens[q]);
    tr.appendChild(th);
    row.forEach((w, k) => {
      const td = tr.insertCell();
      td.className = "attn-cell";
      td.style.background = `rgba(217, 72, 15, ${Math.sqrt(w)})`;
      td.title = `${JSON.stringify(a.tokens[q])} \u2192 ${JSON.stringify(a.tokens[k])}: ${w}`;
    });
  });
  table.dataset.size = `${a.matrix.length}x${a.matrix.length ? a.matrix[0].length : 0}`;
}

$("prompt-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt) { show("type a prompt first"); return; }
  runTrace({ prompt, chat: $("chat").checked, adapter: $("adapter").value || null });
});

$("step").addEventListener("click", () => {
  // the next step runs with the adapter of the trace it continues
  if (current) runTrace({ ids: current.ids.concat([current.next[0].id]), adapter: current.adapter });
});

api("/api/model").then((m) => {
  $("model-name").textContent = `${m.name} \u00b7 ${m.layers} layers \u00b7 ${m.heads} heads`;
  $("chat-label").hidden = !m.chat_template;
  // LoRA adapters loaded with --lora-modules: the page traces the base or one of them
  for (const name of m.adapters || []) {
    const opt = document.createElement("option");
    opt.value = name;
    opt.textContent = name;
    $("adapter").appendChild(opt);
  }
  $("adapter-label").hidden = !(m.adapters && m.adapters.length);
  document.body.dataset.layers = m.layers;
}).catch((e) => show("error: " + e.message));
