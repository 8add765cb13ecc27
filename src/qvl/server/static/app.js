// qvl web page: an image, a PDF and/or a video, a conversation about them, answers streamed from
// /v1/chat/completions (in JSON, under a schema if one is given, when the JSON switch is on);
// boxes and points an answer finds are drawn over the image.
"use strict";

const TASKS = JSON.parse(document.getElementById("qvl-tasks").textContent);  // filled in by qvl serve
const $ = (id) => document.getElementById(id);

// The server refuses a request body over its --max-body-mb (filled in by qvl serve). A file is
// sent base64-encoded: 4/3 of its size.
const MAX_BODY_MB = JSON.parse(document.getElementById("qvl-max-body").textContent) / (1024 * 1024);

const state = {
  image: null,        // data: URL of the chosen image
  pdf: null,          // {url: data: URL, name} of the chosen PDF (its pages are sent as images)
  pdfPages: null,     // the pages the conversation asked about ("" for all); null before the first question
  video: null,        // data: URL of the chosen video
  videoPreview: null, // blob: URL the <video> preview plays (revoked when the video goes)
  history: [],        // OpenAI messages sent so far; the PDF, image and video ride in the first user message
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
    if (res.ok && body.models) {  // several models: each loads on its first request
      const loaded = body.models.filter((m) => m.loaded).map((m) => m.name);
      $("status").textContent = `${body.models.length} models, loaded: ${loaded.join(", ") || "none yet"}`;
      loadModels();
      setTimeout(pollHealth, 5000);
      return;
    }
    if (res.ok) { $("status").textContent = `model ${body.model} ready`; loadModels(); return; }
    $("status").textContent = body.status === "failed" ? `model failed to load: ${body.error}` : `model ${body.status}…`;
    if (body.status === "failed") return;
  } catch (e) {
    $("status").textContent = "server unreachable, retrying…";
  }
  setTimeout(pollHealth, 1000);
}

// The model picker: the names /v1/models lists; the chosen one goes in every request.
async function loadModels() {
  const picker = $("model");
  try {
    const res = await fetch("v1/models", {headers: headers()});
    if (!res.ok) return;  // behind an API key: filled once the key is given
    const names = (await res.json()).data.map((m) => m.id);
    if (names.join("\n") === [...picker.options].map((o) => o.value).join("\n")) return;
    const chosen = picker.value;
    picker.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) picker.value = chosen;
  } catch (e) { /* the status line says the server is unreachable */ }
}

// -- the image, the PDF and the video --------------------------------------------------------

const VIDEO_EXTENSIONS = /\.(mp4|m4v|mov|webm|mkv|avi|mpe?g|ts|3gp|ogv|flv|wmv)$/i;  // for files the browser gives no type

function kindOf(file) {
  if (file.type === "application/pdf" || (!file.type && /\.pdf$/i.test(file.name || ""))) return "PDF";
  if (file.type.startsWith("image/")) return "image";
  if (file.type.startsWith("video/") || (!file.type && VIDEO_EXTENSIONS.test(file.name || ""))) return "video";
  return null;
}

function sizeText(bytes) {
  return bytes >= 1024 * 1024 ? `${(bytes / 1024 / 1024).toFixed(1)} MB` : `${(bytes / 1024).toFixed(0)} KB`;
}

// An error message when the file cannot fit in a request the server takes, else null.
function tooLarge(file, kind) {
  const sent = Math.ceil(file.size / 3) * 4;  // base64
  if (sent <= MAX_BODY_MB * 1024 * 1024) return null;
  return `That ${kind} is too large: ${file.name || kind} is ${sizeText(file.size)}, ${sizeText(sent)} once encoded ` +
    `for sending, and the server takes requests of at most ${MAX_BODY_MB} MB (qvl serve --max-body-mb). ` +
    `Choose a ${kind} under ${Math.floor(MAX_BODY_MB * 3 / 4)} MB.`;
}

// Reads `file` as a data: URL, then calls done(url); a read failure shows an error.
function readFile(file, done) {
  const reader = new FileReader();
  reader.onload = () => done(reader.result);
  reader.onerror = () => showError("Could not read that file.");
  reader.readAsDataURL(file);
}

// Takes one image, one PDF and/or one video from `files` (a drop, the file picker, a paste).
function addFiles(files) {
  const image = files.find((f) => kindOf(f) === "image");
  const pdf = files.find((f) => kindOf(f) === "PDF");
  const video = files.find((f) => kindOf(f) === "video");
  if (!image && !pdf && !video) { showError("That is not an image, a PDF or a video file."); return; }
  const error = (image && tooLarge(image, "image")) || (pdf && tooLarge(pdf, "PDF")) ||
    (video && tooLarge(video, "video"));
  if (error) { showError(error); return; }  // nothing taken: the error stays until the next action
  if (image) setImage(image);
  if (pdf) setPdf(pdf);
  if (video) setVideo(video);
}

function setImage(file, then) {
  readFile(file, (url) => {
    state.image = url;
    $("preview").src = state.image;
    $("preview").hidden = false;
    $("drop-hint").hidden = true;
    $("clear-image").disabled = false;
    $("image-info").textContent = `${file.name || "pasted image"}, ${sizeText(file.size)}`;
    newConversation();
    if (then) then();
  });
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

function setPdf(file) {
  readFile(file, (url) => {
    // a file the browser gives no type reads as application/octet-stream: name it for what it is
    state.pdf = {url: url.replace(/^data:[^;,]*/, "data:application/pdf"), name: file.name || "document.pdf"};
    $("pdf-info").textContent = `${state.pdf.name}, ${sizeText(file.size)}`;
    $("pdf-pages").value = "1";
    $("pdf-box").hidden = false;
    newConversation();
  });
}

function clearPdf() {
  state.pdf = null;
  $("pdf-box").hidden = true;
  $("pdf-info").textContent = "";
  $("file").value = "";
  newConversation();
}

// The pages field: "2", "2-4", "2-4,7" as the server reads them ("" for all pages), or
// undefined (after showing why) when it is not a page selection.
function pdfPages() {
  const text = $("pdf-pages").value.trim();
  if (!text) return "";
  if (!/^\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*$/.test(text)) {
    showError(`"${text}" is not a page selection: write a page number such as 2, or a range such as 2-4 ` +
      "(pages count from 1; leave it empty for every page).");
    $("pdf-pages").focus();
    return undefined;
  }
  return text.replace(/\s+/g, "");
}

function setVideo(file) {
  readFile(file, (url) => {
    dropVideo();
    state.video = url;
    state.videoPreview = URL.createObjectURL(file);
    const info = `${file.name || "pasted video"}, ${sizeText(file.size)}`;
    $("video-info").textContent = info;
    $("video-info").dataset.info = info;
    $("video-preview").hidden = false;
    $("video-fallback").hidden = true;
    $("video-preview").src = state.videoPreview;
    $("video-box").hidden = false;
    newConversation();
  });
}

// Forgets the video and its preview (no new conversation: the caller decides).
function dropVideo() {
  state.video = null;
  if (state.videoPreview) URL.revokeObjectURL(state.videoPreview);
  state.videoPreview = null;
  $("video-preview").removeAttribute("src");
  $("video-preview").load();  // stops any playback and frees the decoder
  $("video-box").hidden = true;
  $("video-info").textContent = "";
}

function clearVideo() {
  dropVideo();
  $("file").value = "";
  newConversation();
}

function wireMediaInputs() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => addFiles([...e.target.files]));
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("file").click(); });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    addFiles([...e.dataTransfer.files]);
  });
  document.addEventListener("paste", (e) => {
    const files = [...e.clipboardData.items].filter((i) => i.kind === "file").map((i) => i.getAsFile())
      .filter((f) => f && kindOf(f));
    if (files.length) { e.preventDefault(); addFiles(files); }
  });
  $("clear-image").addEventListener("click", clearImage);
  $("clear-pdf").addEventListener("click", clearPdf);
  $("clear-video").addEventListener("click", clearVideo);
  const video = $("video-preview");
  video.addEventListener("loadedmetadata", () => {
    if (Number.isFinite(video.duration)) {
      $("video-info").textContent = `${$("video-info").dataset.info}, ${video.duration.toFixed(1)} s`;
    }
  });
  video.addEventListener("error", () => {  // a format this browser cannot play (the server may still read it)
    if (!video.getAttribute("src")) return;
    video.hidden = true;
    $("video-fallback").hidden = false;
  });
}

// -- boxes and points over the image ---------------------------------------------------------

// One colour per label, in the order qvl ask --draw gives them.
const PALETTE = ["#e6194b", "#3cb44b", "#0082c8", "#f58230", "#911eb4", "#46f0f0", "#f032e6", "#d2f53c",
  "#fabed4", "#008080"];

function clearOverlay() {
  $("overlay").replaceChildren();
  $("overlay-info").textContent = "";
  $("overlay-info").hidden = true;
  hideTip();
}

function counted(n, one, many) {
  return `${n} ${n === 1 ? one : many}`;
}

// `v` pixels of a side of `side` pixels as a percentage: marks placed in percentages follow
// the preview at whatever size it is shown.
function percent(v, side) {
  return `${(100 * v / side).toFixed(4)}%`;
}

// A box or a point on the overlay: outlined in its label's colour, with a small tag, and a
// tooltip with the label and the coordinates on hover.
function addMark(kind, label, colour, where) {
  const mark = document.createElement("span");
  mark.className = `mark ${kind}`;
  mark.style.setProperty("--colour", colour);
  mark.setAttribute("role", "img");
  mark.setAttribute("aria-label", `${label || "(no label)"}: ${where}`);
  mark.dataset.label = label;
  mark.dataset.where = where;
  if (label) {
    const tag = document.createElement("span");
    tag.className = "tag";
    tag.textContent = label;
    mark.appendChild(tag);
  }
  mark.addEventListener("mouseenter", () => showTip(mark));
  mark.addEventListener("mouseleave", hideTip);
  $("overlay").appendChild(mark);
  return mark;
}

function showTip(mark) {
  const tip = $("overlay-tip");
  tip.replaceChildren();
  const label = document.createElement("strong");
  label.textContent = mark.dataset.label || "(no label)";
  const where = document.createElement("span");
  where.textContent = ` ${mark.dataset.where}`;
  tip.append(label, where);
  tip.hidden = false;
  const rect = mark.getBoundingClientRect(), room = tip.getBoundingClientRect();
  const below = rect.bottom + 6 + room.height <= window.innerHeight;
  tip.style.left = `${Math.max(4, Math.min(rect.left, window.innerWidth - room.width - 4))}px`;
  tip.style.top = `${below ? rect.bottom + 6 : Math.max(4, rect.top - room.height - 6)}px`;
}

function hideTip() {
  $("overlay-tip").hidden = true;
}

// Draws the boxes and points of an answer's "qvl" extension (in the pixels of an image of
// found.image_size, as the server sends them) over the image preview. Only an image has a
// preview to draw on: boxes of a PDF page (or with no image at all) are only counted.
function drawOverlay(found) {
  clearOverlay();
  const boxes = found.boxes || [], points = found.points || [];
  if (!boxes.length && !points.length) return;
  const what = [boxes.length ? counted(boxes.length, "box", "boxes") : "", points.length ?
    counted(points.length, "point", "points") : ""].filter(Boolean).join(" and ");
  const size = found.image_size;
  if (!state.image || !Array.isArray(size) || !(size[0] > 0 && size[1] > 0)) {
    $("overlay-info").textContent = `The answer holds ${what}; they are drawn over an image only.`;
    $("overlay-info").hidden = false;
    return;
  }
  const [width, height] = size;
  const colours = new Map();
  const colour = (label) => {
    if (!colours.has(label)) colours.set(label, PALETTE[colours.size % PALETTE.length]);
    return colours.get(label);
  };
  const area = (b) => (b.bbox_2d[2] - b.bbox_2d[0]) * (b.bbox_2d[3] - b.bbox_2d[1]);
  for (const box of [...boxes].sort((a, b) => area(b) - area(a))) {  // small boxes on top, to be hovered
    const [x1, y1, x2, y2] = box.bbox_2d;
    const mark = addMark("box", box.label, colour(box.label), `(${x1}, ${y1}) to (${x2}, ${y2})`);
    if (y1 < height * 0.08) mark.classList.add("tag-inside");  // no room above: the tag goes inside
    mark.style.left = percent(x1, width);
    mark.style.top = percent(y1, height);
    mark.style.width = percent(x2 - x1, width);
    mark.style.height = percent(y2 - y1, height);
  }
  for (const point of points) {
    const [x, y] = point.point_2d;
    const mark = addMark("point", point.label, colour(point.label), `(${x}, ${y})`);
    mark.style.left = percent(x, width);
    mark.style.top = percent(y, height);
  }
  $("overlay-info").textContent = `${what} drawn on the image (hover one for its label)`;
  $("overlay-info").hidden = false;
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
  state.pdfPages = null;
  clearOverlay();
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
  if ($("model").value) body.model = $("model").value;
  if (format) body.response_format = format;
  if (task && task.greedy) body.temperature = 0;
  if (task && task.max_image_tokens) body.max_pixels = task.max_image_tokens * 32 * 32;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

// format: the response_format to send (null: none), from responseFormat(); shown: the question
// as the conversation shows it (default: the preset's description, or the text)
async function ask(text, task, format, shown) {
  if (!text.trim() || state.controller) return;
  const pages = state.pdf ? pdfPages() : null;
  if (pages === undefined) return;
  if (state.pdf && state.history.length && pages !== state.pdfPages) newConversation();  // other pages
  showError("");
  clearOverlay();  // a new answer replaces the boxes of the last one
  const content = [];
  if (state.history.length === 0) {  // the media ride in the first question; follow-ups resend it
    if (state.pdf) {  // each page an image; the photo after them, so the server's boxes are in its pixels
      content.push({type: "image_url", image_url: pages ? {url: state.pdf.url, pages} : {url: state.pdf.url}});
      state.pdfPages = pages;
    }
    if (state.image) content.push({type: "image_url", image_url: {url: state.image}});
    if (state.video) content.push({type: "video_url", video_url: {url: state.video}});
  }
  content.push({type: "text", text});
  const history = state.history;  // "new conversation" during the answer replaces state.history
  history.push({role: "user", content});
  addMessage("user", shown || (task ? task.description : text));
  const bubble = addMessage("assistant streaming", "");
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let answer = "", firstMs = null, timings = null, usage = null, failed = false, found = null;
  let thought = null;  // a Thinking model's reasoning, shown dimmed above its answer
  try {
    const res = await fetch("v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify(requestBody(history, task, format)), signal: state.controller.signal});
    if (!res.ok) throw new Error(await errorMessage(res));
    if ($("api-key").value) { sessionStorage.setItem("qvl-key", $("api-key").value); loadModels(); }
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
      if (chunk.qvl) {
        timings = chunk.qvl.timings;
        if (chunk.qvl.boxes || chunk.qvl.points) found = chunk.qvl;  // grounding: boxes and points found
      }
      if (chunk.usage) usage = chunk.usage;
    }
    const pretty = format ? prettyJson(answer) : null;
    if (pretty !== null) {  // shown pretty-printed; the conversation keeps the answer as it came
      bubble.textContent = pretty;
      bubble.classList.add("json");
    }
    showStats(firstMs, timings, usage);
    if (found && history === state.history) drawOverlay(found);  // still the conversation about this image
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

// The response_format to send (null: none) when the page's own fields (the JSON schema, the
// PDF's pages) are fit to send; undefined, after showing why, when they are not.
function readyToAsk() {
  const format = responseFormat();
  if (format === undefined || (state.pdf && pdfPages() === undefined)) return undefined;
  return format;
}

// A preset's prompt; a preset with a subject (detect, point: the categories to find) takes it
// from the field next to it, else from the question box. null (after showing why) when none.
function presetPrompt(task) {
  if (!task.subject) return {prompt: task.prompt, shown: task.description};
  const field = $(`subject-${task.subject}`);
  let subject = field.value.trim();
  if (!subject) {
    subject = $("question").value.trim();
    if (subject) $("question").value = "";  // taken as the categories: not a question to ask again
  }
  if (!subject) {
    showError(`"${task.description}" needs the ${task.subject} to look for: write them in the box next to it, ` +
      `e.g. cats, bicycles.`);
    field.focus();
    return null;
  }
  return {prompt: task.prompt.replace("{}", () => subject), shown: `${task.description}: ${subject}`};
}

function wirePresets() {
  const lastOfSubject = new Map();  // subject -> the last button of a task that needs it
  for (const task of TASKS) {
    const button = document.createElement("button");
    button.type = "button";
    button.dataset.task = task.name;
    button.textContent = task.description;
    button.title = task.subject ? task.prompt.replace("{}", `<${task.subject}>`) : task.prompt;
    button.addEventListener("click", () => {
      const format = readyToAsk();
      if (format === undefined) return;
      const preset = presetPrompt(task);
      if (preset) ask(preset.prompt, task, format, preset.shown);
    });
    $("presets").appendChild(button);
    if (task.subject) lastOfSubject.set(task.subject, button);
  }
  for (const [subject, button] of lastOfSubject) {  // one field per subject, after the presets that use it
    const field = document.createElement("input");
    field.type = "text";
    field.id = `subject-${subject}`;
    field.className = "subject";
    field.dataset.subject = subject;
    field.placeholder = subject === "categories" ? "what to find, e.g. cats, bicycles" : subject;
    field.setAttribute("aria-label", `${subject} for the presets before this field`);
    field.autocomplete = "off";
    button.after(field);
  }
  const free = document.createElement("button");
  free.type = "button";
  free.dataset.task = "free";
  free.textContent = "free question";
  free.addEventListener("click", () => $("question").focus());
  $("presets").appendChild(free);
}

// Example pictures (drawn by the demo tasks' generator, served from static/examples) and what to
// ask about them: a preset task (with its subject) or a free question. The small demo model that
// ./run.sh serves offline answers these right; so does the real model.
const EXAMPLES = [
  {image: "examples/text.png", task: "ocr", label: "read this text"},
  {image: "examples/shapes.png", question: "What colour is the triangle? Answer with one word.", label: "the triangle's colour"},
];

function wireExamples() {
  for (const example of EXAMPLES) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = example.label;
    button.addEventListener("click", async () => {
      const res = await fetch(`static/${example.image}`).catch(() => null);
      if (!res || !res.ok) { showError(`Could not load the example picture ${example.image}.`); return; }
      const blob = await res.blob();
      setImage(new File([blob], example.image.split("/").pop(), {type: blob.type}), () => {
        if (!example.task) {
          $("question").value = example.question;
          $("ask-form").requestSubmit();
          return;
        }
        const task = TASKS.find((t) => t.name === example.task);
        if (task.subject) $(`subject-${task.subject}`).value = example.subject;
        $("presets").querySelector(`[data-task="${task.name}"]`).click();
      });
    });
    $("examples").appendChild(button);
  }
}

function wireForm() {
  $("ask-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const format = readyToAsk();
    if (format === undefined) return;  // the question stays in its box until the schema or pages are fixed
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

// -- search over the server's index (qvl serve --index) ----------------------------------------

const SEARCH_RESULTS = 12;
let thumbnails = [];  // blob: URLs of the shown results' thumbnails (revoked by the next search)

async function wireSearch() {
  if (!JSON.parse($("qvl-index").textContent)) return;  // filled in by qvl serve: no index, no search box
  $("search-pane").hidden = false;
  $("search-form").addEventListener("submit", (e) => {
    e.preventDefault();
    search($("search-query").value.trim());
  });
  try {
    const res = await fetch("v1/index", {headers: headers()});
    if (!res.ok) return;  // an API key not given yet: the counts stay unsaid
    const info = await res.json();
    $("search-info").textContent = `${counted(info.entries, "entry", "entries")} from ${counted(info.files, "file", "files")}`;
    if (info.reranker) {  // qvl serve --reranker: the results may be ordered by it
      $("search-rerank-label").hidden = false;
      $("search-rerank-label").title = `score the nearest entries with ${info.reranker} and order them by it`;
    }
  } catch (e) { /* the counts are a nicety */ }
}

async function search(text) {
  if (!text) return;
  showError("");
  thumbnails.forEach((url) => URL.revokeObjectURL(url));
  thumbnails = [];
  $("search-results").replaceChildren();
  $("search-button").disabled = true;
  try {
    const res = await fetch("v1/search", {method: "POST", headers: headers(), body: JSON.stringify({query: text, k: SEARCH_RESULTS, rerank: $("search-rerank").checked})});
    if (!res.ok) { showError(await errorMessage(res)); return; }
    const body = await res.json();
    if (!body.results.length) $("search-results").textContent = "nothing indexed yet";
    body.results.forEach((hit) => $("search-results").appendChild(resultCard(hit)));
  } catch (e) {
    showError(`search failed: ${e.message}`);
  } finally {
    $("search-button").disabled = false;
  }
}

function resultCard(hit) {
  const name = hit.path.split(/[\\/]/).pop();
  const where = hit.page ? `${name}, page ${hit.page}` : name;
  const card = document.createElement("figure");
  card.className = "hit";
  const img = document.createElement("img");
  img.alt = where;
  const caption = document.createElement("figcaption");
  const rerank = hit.rerank_score === undefined ? "" : `rerank ${hit.rerank_score.toFixed(3)} · `;
  caption.textContent = `${rerank}${hit.score.toFixed(3)} · ${where}`;
  caption.title = hit.path;
  card.append(img, caption);
  showThumbnail(img, hit.thumbnail);
  return card;
}

// Fetched with the API key (an <img src> could not send it) and shown from a blob: URL.
async function showThumbnail(img, url) {
  try {
    const res = await fetch(url.replace(/^\//, ""), {headers: headers()});
    if (!res.ok) { img.alt += ` (no thumbnail: ${await errorMessage(res)})`; return; }
    const blob = URL.createObjectURL(await res.blob());
    thumbnails.push(blob);
    img.src = blob;
  } catch (e) {
    img.alt += " (no thumbnail)";
  }
}

wireMediaInputs();
wirePresets();
wireExamples();
wireForm();
wireSearch();
pollHealth();
