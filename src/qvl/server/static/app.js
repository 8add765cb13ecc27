// qvl web page: one image, a conversation about it, answers streamed from /v1/chat/completions
// (in JSON, under a schema if one is given, when the JSON switch is on).
"use strict";

const TASKS = JSON.parse(document.getElementById("qvl-tasks").textContent);  // filled in by qvl serve
const $ = (id) => document.getElementById(id);

const state = {
  image: null,        // data: URL of the chosen image
  history: [],        // OpenAI messages sent so far; the image rides in the first user message
  controller: null,   // AbortController of the running request
};

// -- status and errors ------------------------------------------------------------------------

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function pollHealth() {
  try {
    const res = await fetch("health");
    const body = await res.json();
    if (res.ok) { $("status").textContent = `model ${body.model} ready`; return; }
    $("status").textContent = body.status === "failed" ? `model failed to load: ${body.error}` : `model ${body.status}…`;
    if (body.status === "failed") return;
  } catch (e) {
    $("status").textContent = "server unreachable, retrying…";
  }
  setTimeout(pollHealth, 1000);
}

// -- the image --------------------------------------------------------------------------------

function setImage(file) {
  if (!file || !file.type.startsWith("image/")) { showError("That is not an image file."); return; }
  const reader = new FileReader();
  reader.onload = () => {
    state.image = reader.result;
    $("preview").src = state.image;
    $("preview").hidden = false;
    $("drop-hint").hidden = true;
    $("clear-image").disabled = false;
    $("image-info").textContent = `${file.name || "pasted image"}, ${(file.size / 1024).toFixed(0)} KB`;
    newConversation();
  };
  reader.onerror = () => showError("Could not read that file.");
  reader.readAsDataURL(file);
}

function clearImage() {
  state.image = null;
  $("preview").hidden = true;
  $("preview").removeAttribute("src");
  $("drop-hint").hidden = false;
  $("clear-image").disabled = true;
  $("image-info").textContent = "";
  $("file").value = "";
  newConversation();
}

function wireImageInputs() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => setImage(e.target.files[0]));
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("file").click(); });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    setImage(e.dataTransfer.files[0]);
  });
  document.addEventListener("paste", (e) => {
    const item = [...e.clipboardData.items].find((i) => i.type.startsWith("image/"));
    if (item) { e.preventDefault(); setImage(item.getAsFile()); }
  });
  $("clear-image").addEventListener("click", clearImage);
}

// -- the conversation -------------------------------------------------------------------------

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("conversation").appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function newConversation() {
  stop();
  state.history = [];
  $("conversation").replaceChildren();
  $("stats").textContent = "";
  showError("");
}

function setBusy(busy) {
  $("ask").disabled = busy;
  $("stop").disabled = !busy;
  document.querySelectorAll("#presets button").forEach((b) => { b.disabled = busy; });
}

function stop() {
  if (state.controller) state.controller.abort();
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value || sessionStorage.getItem("qvl-key");
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// Yields the data of each Server-Sent Event in a fetch response body.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

async function errorMessage(res) {
  if (res.status === 401) {
    $("key-row").hidden = false;
    $("api-key").focus();
  }
  try { return (await res.json()).error.message; } catch (e) { return `HTTP ${res.status} ${res.statusText}`; }
}

function showStats(clientTtftMs, timings, usage) {
  const ttft = timings ? timings.ttft_ms : clientTtftMs;
  const parts = [];
  if (ttft != null) parts.push(`time to first token ${(ttft / 1000).toFixed(2)} s`);
  if (timings && timings.decode_ms_per_token > 0) parts.push(`${(1000 / timings.decode_ms_per_token).toFixed(1)} tokens/s`);
  if (usage) parts.push(`${usage.completion_tokens} tokens (prompt ${usage.prompt_tokens})`);
  $("stats").textContent = parts.join(" · ");
}

// -- JSON answers -----------------------------------------------------------------------------

// The response_format the JSON switch asks for: null when it is off, json_object for an empty
// schema box, else json_schema; undefined (after showing why) when the box is not a JSON object.
function responseFormat() {
  if (!$("json-mode").checked) return null;
  const text = $("json-schema").value.trim();
  if (!text) return {type: "json_object"};
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (e) {
    showError(`The JSON schema is not valid JSON: ${e.message}`);
    return undefined;
  }
  if (typeof schema !== "object" || schema === null || Array.isArray(schema)) {
    showError("The JSON schema must be a JSON object ({…}).");
    return undefined;
  }
  return {type: "json_schema", json_schema: {name: "answer", schema}};
}

// The answer pretty-printed if it is JSON, else null (cut by max tokens, or stopped).
function prettyJson(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch (e) { return null; }
}

function requestBody(history, task, format) {
  const body = {messages: history, stream: true, stream_options: {include_usage: true}};
  if (format) body.response_format = format;
  if (task && task.greedy) body.temperature = 0;
  if (task && task.max_image_tokens) body.max_pixels = task.max_image_tokens * 32 * 32;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

// format: the response_format to send (null: none), from responseFormat()
async function ask(text, task, format) {
  if (!text.trim() || state.controller) return;
  showError("");
  const content = state.history.length === 0 && state.image ? [{type: "image_url", image_url: {url: state.image}}] : [];
  content.push({type: "text", text});
  const history = state.history;  // "new conversation" during the answer replaces state.history
  history.push({role: "user", content});
  addMessage("user", task ? task.description : text);
  const bubble = addMessage("assistant streaming", "");
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let answer = "", firstMs = null, timings = null, usage = null, failed = false;
  let thought = null;  // a Thinking model's reasoning, shown dimmed above its answer
  try {
    const res = await fetch("v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify(requestBody(history, task, format)), signal: state.controller.signal});
    if (!res.ok) throw new Error(await errorMessage(res));
    if ($("api-key").value) sessionStorage.setItem("qvl-key", $("api-key").value);
    for await (const data of sseData(res.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const reasoning = chunk.choices.length ? chunk.choices[0].delta.reasoning_content : null;
      if (reasoning) {
        if (firstMs === null) firstMs = performance.now() - started;
        if (thought === null) {
          thought = document.createElement("div");
          thought.className = "msg thinking";
          bubble.before(thought);
        }
        thought.textContent += reasoning;
        bubble.scrollIntoView({block: "end"});
      }
      const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
      if (delta) {
        if (firstMs === null) firstMs = performance.now() - started;
        answer += delta;
        bubble.textContent = answer;
        bubble.scrollIntoView({block: "end"});
      }
      if (chunk.qvl) timings = chunk.qvl.timings;
      if (chunk.usage) usage = chunk.usage;
    }
    const pretty = format ? prettyJson(answer) : null;
    if (pretty !== null) {  // shown pretty-printed; the conversation keeps the answer as it came
      bubble.textContent = pretty;
      bubble.classList.add("json");
    }
    showStats(firstMs, timings, usage);
  } catch (e) {
    if (e.name === "AbortError") {
      bubble.classList.add("stopped");
      showStats(firstMs, null, null);
    } else {
      failed = true;
      showError(e.message);
    }
  } finally {
    bubble.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
  }
  if (failed && !answer) {  // forget the question so it can be asked again
    history.pop();
    bubble.remove();
  } else {
    history.push({role: "assistant", content: answer});
  }
}

// -- presets and the form ---------------------------------------------------------------------

function wirePresets() {
  for (const task of TASKS) {
    const button = document.createElement("button");
    button.type = "button";
    button.dataset.task = task.name;
    button.textContent = task.description;
    button.title = task.prompt;
    button.addEventListener("click", () => {
      const format = responseFormat();
      if (format !== undefined) ask(task.prompt, task, format);
    });
    $("presets").appendChild(button);
  }
  const free = document.createElement("button");
  free.type = "button";
  free.dataset.task = "free";
  free.textContent = "free question";
  free.addEventListener("click", () => $("question").focus());
  $("presets").appendChild(free);
}

function wireForm() {
  $("ask-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const format = responseFormat();
    if (format === undefined) return;  // the question stays in its box until the schema is fixed
    const text = $("question").value;
    $("question").value = "";
    ask(text, null, format);
  });
  $("json-mode").addEventListener("change", () => { $("json-schema").hidden = !$("json-mode").checked; });
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newConversation);
}

wireImageInputs();
wirePresets();
wireForm();
pollHealth();
