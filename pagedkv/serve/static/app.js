// The chat page: streams an answer from /v1/chat/completions and draws the KV pool from
// the same event stream (the server adds a "pool" string to chunks when asked: one
// character a block). Between answers the pool is read from GET /pool.
"use strict";

const KIND = { ".": "free", "c": "cached", "m": "mine", "s": "shared", "o": "others",
               "u": "others" };
const $ = (id) => document.getElementById(id);
let model = null, history = [], busy = false, peakShared = 0;
let apiKey = sessionStorage.getItem("pagedkv-api-key");

async function api(path, options, ask) {
  // fetch with the server's API key, if it has one; with ask, a 401 asks for the key once
  const call = () => {
    const headers = Object.assign({}, (options || {}).headers);
    if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
    return fetch(path, Object.assign({}, options, { headers: headers }));
  };
  let r = await call();
  if (r.status === 401 && ask) {
    const key = window.prompt("This server needs its API key (--api-key):");
    if (key) {
      apiKey = key;
      sessionStorage.setItem("pagedkv-api-key", key);
      r = await call();
    }
  }
  return r;
}

function drawPool(map) {
  const pool = $("pool");
  while (pool.children.length < map.length) {
    const cell = document.createElement("span");
    cell.className = "block free";
    pool.appendChild(cell);
  }
  const counts = { free: 0, cached: 0, mine: 0, shared: 0, others: 0 };
  for (let i = 0; i < map.length; i++) {
    const kind = KIND[map[i]] || "others";
    counts[kind] += 1;
    const cell = pool.children[i];
    if (cell.className !== "block " + kind) cell.className = "block " + kind;
    cell.title = "block " + i + ": " + kind;
  }
  for (const k in counts) $("n-" + k).textContent = counts[k];
  peakShared = Math.max(peakShared, counts.shared);
  $("peak-shared").textContent = peakShared;
}

async function refreshPool() {
  if (busy) return;
  try {
    const r = await api("/pool");
    if (r.ok && !busy) {
      const p = await r.json();
      drawPool(p.blocks.replace(/s/g, "o"));   // between answers nothing is this chat's
    }
  } catch (e) { /* the server is gone: keep the last picture */ }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function* events(response) {
  // Server-sent events: "data: {...}" lines separated by blank lines.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  busy = true;
  $("send").disabled = true;
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const t0 = performance.now();
  const body = {
    model: model, messages: history, stream: true, pool: true,
    stream_options: { include_usage: true },
    max_tokens: parseInt($("max-tokens").value, 10),
    temperature: parseFloat($("temperature").value),
  };
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body) }, true);
    if (!r.ok) {
      const err = await r.json();
      answer.className = "msg error";
      answer.textContent = "HTTP " + r.status + ": " + err.error.message;
      history.pop();
      return;
    }
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.pool) drawPool(chunk.pool);
      for (const c of chunk.choices || []) {
        if (c.delta && c.delta.content) answer.textContent += c.delta.content;
      }
      if (chunk.usage) {
        const s = ((performance.now() - t0) / 1000).toFixed(1);
        $("status").textContent = chunk.usage.prompt_tokens + " prompt tokens, " +
          chunk.usage.completion_tokens + " generated, " + s + " s";
      }
    }
    history.push({ role: "assistant", content: answer.textContent });
  } catch (e) {
    answer.className = "msg error";
    answer.textContent = String(e);
  } finally {
    busy = false;
    $("send").disabled = false;
    refreshPool();
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || busy || !model) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("form").requestSubmit();
  }
});
$("new-chat").addEventListener("click", () => {
  history = [];
  $("messages").textContent = "";
});

api("/v1/models", {}, true).then((r) => r.json()).then((m) => {
  model = m.data[0].id;
  $("model").textContent = model;
  document.body.dataset.ready = "1";
});
refreshPool();
setInterval(refreshPool, 1000);
