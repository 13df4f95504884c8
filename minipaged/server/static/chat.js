/* minipaged's chat page.

   The conversation lives here, in `conversation`: each question sends all of
   it (with the system prompt in front) to POST /v1/chat/completions with
   stream: true, and the answer is drawn as its server-sent events arrive.
   fetch + ReadableStream, not EventSource: EventSource can only GET. Stop
   aborts the fetch; the server sees its client leave and aborts the engine
   request, which frees its KV blocks.

   Model output is only ever put in the page as text (Text nodes,
   textContent), never as markup, so an answer cannot inject anything. */
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), system: $("system"), temperature: $("temperature"),
  maxTokens: $("max-tokens"), apiKey: $("api-key"), extra: $("extra"),
  transcript: $("transcript"), error: $("error"), form: $("chat-form"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"), clear: $("clear"),
};

/** Every finished turn, {role, content}, user and assistant in order. The
    system prompt is not kept here: it is read at each question, so an edit
    applies to the next one. */
const conversation = [];
let modelName = null;   // from GET /v1/models; each request names it
let controller = null;  // the AbortController of the answer in flight, if any

// -- talking to the server -------------------------------------------------------------

/** Request headers; Authorization only when the user typed a key. */
function headers(withJson) {
  const result = {};
  if (withJson) result["Content-Type"] = "application/json";
  const key = ui.apiKey.value.trim();
  if (key) result["Authorization"] = `Bearer ${key}`;
  return result;
}

/** The message of a refused request: OpenAI's {"error": {"message"}} body,
    else FastAPI's {"detail"}, else the status and the start of the body. */
async function errorMessage(response) {
  let text = "";
  try { text = await response.text(); } catch (_) { /* no body */ }
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
    if (body && typeof body.detail === "string") return body.detail;
  } catch (_) { /* not JSON */ }
  const status = `HTTP ${response.status} ${response.statusText}`.trim();
  return text ? `${status}: ${text.slice(0, 300)}` : status;
}

/** Reads the served model's name into the page; null (and an error shown) if
    the server refuses, e.g. for a missing API key. */
async function loadModel() {
  ui.model.textContent = "loading…";
  try {
    const response = await fetch("v1/models", { headers: headers(false) });
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    modelName = body.data[0].id;
    ui.model.textContent = modelName;
    clearError();
  } catch (err) {
    modelName = null;
    ui.model.textContent = "unknown";
    showError(`Could not read the model from /v1/models: ${err.message}`);
  }
  return modelName;
}

/** Server-sent events, parsed incrementally: push() takes the text of each
    read and returns the data of every event that text completed. A read
    may end anywhere, even inside a line, so the unfinished rest is kept. */
class SSEParser {
  constructor() { this.buffer = ""; this.data = []; }

  push(text) {
    this.buffer += text;
    const events = [];
    const lineEnd = /\r\n|\r|\n/g;   // the three line ends the format allows
    let start = 0;
    let match;
    while ((match = lineEnd.exec(this.buffer)) !== null) {
      // A lone \r at the very end may be the first half of \r\n: wait for more.
      if (match[0] === "\r" && lineEnd.lastIndex === this.buffer.length) break;
      const line = this.buffer.slice(start, match.index);
      start = lineEnd.lastIndex;
      if (line === "") {              // a blank line ends an event
        if (this.data.length) events.push(this.data.join("\n"));
        this.data = [];
      } else if (line.startsWith("data:")) {
        this.data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
      // The API sends no other fields (event:, id:, retry:); comments start with ":".
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }
}

/** The body of one request: the page's fields over the extra JSON fields
    (so those cannot turn streaming off, which this page needs). Throws on
    extra text that is not a JSON object. */
function requestBody(messages) {
  let extra = {};
  const extraText = ui.extra.value.trim();
  if (extraText) {
    extra = JSON.parse(extraText);
    if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {
      throw new Error("not a JSON object");
    }
  }
  const body = {
    ...extra, model: modelName, messages, stream: true,
    stream_options: { ...(extra.stream_options || {}), include_usage: true },
  };
  // Empty fields are left out: the server's defaults apply.
  if (ui.temperature.value.trim() !== "") body.temperature = Number(ui.temperature.value);
  if (ui.maxTokens.value.trim() !== "") body.max_tokens = Number(ui.maxTokens.value);
  return body;
}

// -- the page ----------------------------------------------------------------------------

function showError(message) { ui.error.textContent = message; ui.error.hidden = false; }
function clearError() { ui.error.textContent = ""; ui.error.hidden = true; }

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.clear.disabled = busy;
  ui.stop.disabled = !busy;
}

/** Appends one turn to the transcript. Its text is a single Text node that
    the stream grows with appendData: text, never markup. */
function addTurn(role, text) {
  const root = document.createElement("article");
  root.className = `turn ${role}`;
  const label = document.createElement("p");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Assistant";
  const content = document.createElement("p");
  content.className = "content";
  const node = document.createTextNode(text);
  content.append(node);
  root.append(label, content);
  let stats = null;
  if (role === "assistant") {
    stats = document.createElement("p");
    stats.className = "stats";
    root.append(stats);
  }
  ui.transcript.append(root);
  return { root, node, stats };
}

/** Keep the newest text in view, unless the user has scrolled up to read. */
function followTranscript(wasAtBottom) {
  if (wasAtBottom) window.scrollTo(0, document.documentElement.scrollHeight);
}

function nearBottom() {
  const doc = document.documentElement;
  return doc.scrollHeight - (window.scrollY + window.innerHeight) < 80;
}

/** Time to first token, tokens and tokens/s of one answer, in its stats line
    and as data-* attributes. Tokens: the usage chunk's completion_tokens,
    or, when none came (a stopped answer), the content chunks counted (one
    per engine step). Tokens/s: the tokens after the first over the time
    from the first to the last, the decode rate, which the wait for the
    first token (queueing, prefill) does not dilute. */
function showStats(answer, t) {
  const tokens = t.usage ? t.usage.completion_tokens : t.chunks;
  const parts = [];
  if (t.firstAt !== null) {
    const ttft = t.firstAt - t.started;
    answer.root.dataset.ttftMs = ttft.toFixed(1);
    parts.push(`first token ${Math.round(ttft)} ms`);
  }
  answer.root.dataset.tokens = String(tokens);
  parts.push(`${tokens} token${tokens === 1 ? "" : "s"}${t.usage ? "" : " (counted)"}`);
  if (tokens > 1 && t.lastAt > t.firstAt) {
    const rate = (tokens - 1) / ((t.lastAt - t.firstAt) / 1000);
    answer.root.dataset.tokensPerS = rate.toFixed(1);
    parts.push(`${rate.toFixed(1)} tokens/s`);
  }
  const state = answer.root.dataset.state;
  if (state === "stopped") parts.push("stopped");
  else if (state === "error") parts.push("failed");
  else if (t.finish) parts.push(`finish: ${t.finish}`);
  answer.stats.textContent = parts.join(" · ");
}

/** Sends the conversation with `question` added and streams the answer in. */
async function ask(question) {
  clearError();
  if (modelName === null && (await loadModel()) === null) return;
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation, { role: "user", content: question });
  let body;
  try {
    body = requestBody(messages);
  } catch (err) {
    showError(`Extra request fields: ${err.message}`);
    return;
  }

  ui.prompt.value = "";
  const asked = addTurn("user", question);
  const answer = addTurn("assistant", "");
  answer.root.dataset.state = "streaming";
  controller = new AbortController();
  setBusy(true);
  followTranscript(true);

  const t = { started: performance.now(), firstAt: null, lastAt: null, chunks: 0,
              usage: null, finish: null };
  let text = "";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();   // stream: true below keeps a split UTF-8 character
    const parser = new SSEParser();
    let done = false;
    for (;;) {
      const read = await reader.read();
      if (read.done) break;
      for (const data of parser.push(decoder.decode(read.value, { stream: true }))) {
        if (data === "[DONE]") { done = true; continue; }
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
        if (event.usage) t.usage = event.usage;
        for (const choice of event.choices || []) {
          if (choice.index !== 0) continue;   // the page shows the first choice (n = 1)
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            const now = performance.now();
            if (t.firstAt === null) t.firstAt = now;
            t.lastAt = now;
            t.chunks += 1;
            const atBottom = nearBottom();
            answer.node.appendData(delta);
            text += delta;
            followTranscript(atBottom);
          }
          if (choice.finish_reason) t.finish = choice.finish_reason;
        }
      }
    }
    if (!done) throw new Error("the stream ended before its [DONE] event");
    answer.root.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      answer.root.dataset.state = "stopped";
    } else {
      answer.root.dataset.state = "error";
      showError(err.message);
    }
  } finally {
    controller = null;
    setBusy(false);
  }

  if (text === "" && answer.root.dataset.state !== "done") {
    // Nothing came back: forget the turn and give the question back to retry.
    asked.root.remove();
    answer.root.remove();
    if (ui.prompt.value === "") ui.prompt.value = question;
  } else {
    // What the user saw is what the model said, stopped or not: the next
    // question continues from it.
    conversation.push({ role: "user", content: question }, { role: "assistant", content: text });
    showStats(answer, t);
  }
  ui.prompt.focus();
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const question = ui.prompt.value;
  if (controller === null && question.trim() !== "") ask(question);
});

// Enter sends; Shift+Enter is a new line (and Enter while an IME composes is the IME's).
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});

ui.stop.addEventListener("click", () => { if (controller !== null) controller.abort(); });

ui.clear.addEventListener("click", () => {
  conversation.length = 0;
  ui.transcript.replaceChildren();
  clearError();
  ui.prompt.focus();
});

// A new key may unlock /v1/models (the server answers 401 without the right one).
ui.apiKey.addEventListener("change", loadModel);

loadModel();
