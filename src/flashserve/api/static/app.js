// The chat page: a client of the public API only (GET /v1/models, POST /v1/chat/completions with
// stream: true). No framework, no build step; text is always inserted as text, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"),
  apiKey: $("api-key"), status: $("status"), log: $("log"), empty: $("empty"), form: $("composer"),
  message: $("message"), send: $("send"), stop: $("stop"), newChat: $("new-chat"),
};

// The conversation sent with each request: user and assistant turns (the system prompt is added).
let history = [];
let running = null; // {controller} while a reply streams
let chat = 0; // which conversation is shown: New chat moves on, and a reply of an older one is dropped

// ---- settings: kept in localStorage, the API key only for this tab (sessionStorage) ----------
const SAVED = [["system", ui.system], ["temperature", ui.temperature], ["maxTokens", ui.maxTokens]];
for (const [name, field] of SAVED) {
  const value = localStorage.getItem("flashserve." + name);
  if (value !== null) field.value = value;
  field.addEventListener("change", () => localStorage.setItem("flashserve." + name, field.value));
}
ui.apiKey.value = sessionStorage.getItem("flashserve.apiKey") || "";
ui.apiKey.addEventListener("change", () => {
  sessionStorage.setItem("flashserve.apiKey", ui.apiKey.value);
  loadModels();
});
ui.model.addEventListener("change", () => localStorage.setItem("flashserve.model", ui.model.value));

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// An error in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) as one readable line.
async function describeFailure(response) {
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON */ }
  return describeError(body && body.error, response.status);
}

function describeError(error, status) {
  if (!error) return `The server answered HTTP ${status}.`;
  const detail = [status ? `HTTP ${status}` : null, error.code || error.type, error.param ? `param: ${error.param}` : null];
  return `${error.message || "Request failed."} (${detail.filter(Boolean).join(", ")})`;
}

async function loadModels() {
  ui.status.textContent = "";
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) {
      ui.status.textContent = "Could not list models: " + (await describeFailure(response));
      return;
    }
    const models = (await response.json()).data || [];
    const wanted = localStorage.getItem("flashserve.model");
    ui.model.replaceChildren(...models.map((m) => new Option(m.id, m.id, false, m.id === wanted)));
  } catch (err) {
    ui.status.textContent = "Could not reach the server: " + err.message;
  }
}

// ---- the conversation view ------------------------------------------------------------------
function nearBottom() {
  return ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 80;
}

function addMessage(role, text) {
  ui.empty.hidden = true;
  const follow = nearBottom();
  const article = document.createElement("article");
  article.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : role === "assistant" ? "Assistant" : "Error";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  article.append(who, content);
  ui.log.append(article);
  if (follow) ui.log.scrollTop = ui.log.scrollHeight;
  return article;
}

function showError(text) {
  const article = addMessage("error", text);
  article.setAttribute("role", "alert");
}

function footnote(article, text, cls) {
  const note = document.createElement("div");
  note.className = "stats" + (cls ? " " + cls : "");
  note.textContent = text;
  article.append(note);
}

// Time to first token, and decode speed: the tokens after the first over the time after it.
function statsLine(t) {
  const parts = [];
  if (t.first !== null) parts.push(`TTFT ${Math.round(t.first - t.start)} ms`);
  const tokens = t.tokens ?? t.chunks;
  const seconds = t.first !== null ? (t.end - t.first) / 1000 : 0;
  if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tok/s`);
  parts.push(`${t.tokens === null ? "~" : ""}${tokens} tokens`);
  return parts.join(" · ");
}

// ---- sending and streaming --------------------------------------------------------------------
function setRunning(value) {
  running = value;
  ui.send.disabled = value !== null;
  ui.stop.disabled = value === null;
  ui.log.setAttribute("aria-busy", value !== null ? "true" : "false");
}

function requestBody() {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = { messages: messages.concat(history), stream: true, stream_options: { include_usage: true } };
  if (ui.model.value) body.model = ui.model.value;
  const temperature = parseFloat(ui.temperature.value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt(ui.maxTokens.value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  return body;
}

async function send() {
  const text = ui.message.value;
  if (running || !text.trim()) return;
  ui.message.value = "";
  const userArticle = addMessage("user", text);
  history.push({ role: "user", content: text });
  const controller = new AbortController();
  const mine = chat;
  setRunning({ controller });
  const t = { start: performance.now(), first: null, end: null, tokens: null, chunks: 0 };
  let reply = null; // the assistant's article, made at the first text
  let textNode = null;
  let finish = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await describeFailure(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(describeError(event.error));
      if (event.usage) t.tokens = event.usage.completion_tokens;
      for (const choice of event.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (reply === null) {
            t.first = performance.now();
            reply = addMessage("assistant", "");
            textNode = reply.querySelector(".content").appendChild(document.createTextNode(""));
          }
          const follow = nearBottom();
          textNode.appendData(delta);
          t.chunks += 1;
          if (follow) ui.log.scrollTop = ui.log.scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    t.end = performance.now();
    if (mine !== chat) return;
    if (reply === null) reply = addMessage("assistant", "");
    history.push({ role: "assistant", content: textNode ? textNode.data : "" });
    footnote(reply, statsLine(t) + (finish === "length" ? " · stopped at max tokens" : ""));
    reply.classList.add("done");
  } catch (err) {
    t.end = performance.now();
    if (mine !== chat) {
      // New chat stopped this reply: it belongs to a conversation no longer shown.
    } else if (controller.signal.aborted) {
      // Stopped: keep what arrived, so the next turn follows on from it.
      if (reply === null) reply = addMessage("assistant", "");
      history.push({ role: "assistant", content: textNode ? textNode.data : "" });
      footnote(reply, (t.first !== null ? statsLine(t) + " · " : "") + "stopped", "stopped");
      reply.classList.add("done");
    } else {
      // Failed: the turn (and any partial reply shown) leaves the conversation; its text goes
      // back into the box to send again.
      history.pop();
      userArticle.classList.add("failed");
      if (!ui.message.value) ui.message.value = text;
      showError(err.message);
    }
  } finally {
    setRunning(null);
    if (document.activeElement === ui.stop || document.activeElement === document.body) ui.message.focus();
  }
}

// Server-sent events from a fetch body: yields each `data:` payload parsed as JSON until [DONE].
async function* sseEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  while (true) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function stop() {
  if (running) running.controller.abort();
}

function newChat() {
  stop();
  chat += 1;
  history = [];
  ui.log.replaceChildren(ui.empty);
  ui.empty.hidden = false;
  ui.message.focus();
}

// ---- keyboard and buttons -----------------------------------------------------------------------
ui.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
ui.message.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && running) { e.preventDefault(); stop(); }
});
ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", newChat);

loadModels();
