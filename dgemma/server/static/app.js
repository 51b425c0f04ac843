// The playground page: chat (system prompt, history) and completion tabs, parameters with the checkpoint's
// defaults, answers streamed with their drafts into the canvas view, Stop (aborts the request, which closes the
// stream and frees the server's slot), replay of the last answer, and the API key (kept in memory only).
import { ApiError, Client } from "./api.js";
import { CanvasView } from "./canvas.js";
import { bindAttach, detach, parts, userContent } from "./images.js";

const $ = (id) => document.getElementById(id);
const client = new Client();
const view = new CanvasView({ grid: $("canvas"), counter: $("counter"), committed: $("committed"),
                              stats: $("stats").tBodies[0], usage: $("usage") });
const state = { mode: "chat", model: null, history: [], controller: null, recording: [], cancelReplay: null };
const PARAMS = { "max-tokens": "max_tokens", steps: "max_denoising_steps", "t-max": "t_max", "t-min": "t_min",
                 "entropy-bound": "entropy_bound" };

// ---- page state -------------------------------------------------------------------------------------------
const SAID = { done: "The answer is complete.", stopped: "Stopped." };

function setState(name) {
  if (SAID[name] && document.body.dataset.state !== name) $("announce").textContent = SAID[name];
  document.body.dataset.state = name;
  const busy = name === "running" || name === "replaying";
  $("send").disabled = busy || !state.model;
  $("stop").disabled = !busy;
  $("replay").disabled = busy || !state.recording.length;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// ---- the model and its defaults ----------------------------------------------------------------------------
async function loadModel() {
  try {
    const card = (await client.get("/v1/models")).data[0];
    if (!card.dgemma_defaults) {
      $("model-status").textContent = "the model is loading…";
      setTimeout(loadModel, 1000);
      return;
    }
    state.model = card;
    const d = card.dgemma_defaults;
    $("model-status").textContent = `model ${card.id} · canvas ${d.canvas_length} tokens · context ` +
      `${card.max_model_len} tokens`;
    view.setLength(d.canvas_length);
    buildKnobs(card.dgemma_knobs || []);
    fillDefaults();
    clearError();
    setState("idle");
  } catch (e) {
    state.model = null;
    const keyWanted = e instanceof ApiError && e.status === 401;
    const why = client.key ? "the API key was refused" : "this server needs an API key";
    $("model-status").textContent = keyWanted ? why : "cannot reach the server";
    showError(e.readable || String(e));
    if (keyWanted) $("api-key").focus();
    setState("locked");
  }
}

function fillDefaults() {
  const d = state.model.dgemma_defaults;
  for (const [id, name] of Object.entries(PARAMS)) $(id).value = d[name];
  $("seed").value = "";
  for (const knob of state.model.dgemma_knobs || []) $(`knob-${knob.name}`).value = "";
}

// The server's sampling knobs (the model card lists them): one input each, empty means off.
function buildKnobs(knobs) {
  const box = $("knobs");
  box.replaceChildren();
  for (const knob of knobs) {
    const div = document.createElement("div");
    const label = document.createElement("label");
    const input = document.createElement("input");
    input.id = label.htmlFor = `knob-${knob.name}`;
    label.textContent = knob.name.replaceAll("_", " ");
    input.title = knob.help;
    input.placeholder = knob.type === "map" ? "id:bias, id:bias" : "off";
    if (knob.type !== "map") Object.assign(input, { type: "number", step: "any", inputMode: "decimal" });
    div.append(label, input);
    box.append(div);
  }
}

function knobValues() {
  const out = {};
  for (const knob of state.model.dgemma_knobs || []) {
    const text = $(`knob-${knob.name}`).value.trim();
    if (text === "") continue;
    out[knob.name] = knob.type === "map" ? Object.fromEntries(text.split(",").map((pair) =>
      pair.split(":").map((s) => s.trim())).map(([id, bias]) => [id, Number(bias)])) : Number(text);
  }
  return out;
}

function number(id) {
  const text = $(id).value.trim();
  return text === "" || !Number.isFinite(Number(text)) ? undefined : Number(text);
}

function requestBody() {
  const body = { model: state.model.id, stream: true, stream_options: { include_usage: true }, dgemma_drafts: true,
                 max_tokens: number("max-tokens"), seed: number("seed"), dgemma_sampling: {} };
  for (const id of ["steps", "t-max", "t-min", "entropy-bound"]) body.dgemma_sampling[PARAMS[id]] = number(id);
  if (state.mode === "chat" && $("think").checked) {  // the template's thinking mode: the thought comes apart
    body.chat_template_kwargs = { enable_thinking: true };
    body.max_thinking_tokens = number("max-thinking");
  }
  return Object.assign(body, knobValues());  // undefined fields are left out by JSON.stringify: the server uses the checkpoint's
}

// ---- conversation ------------------------------------------------------------------------------------------
function addMessage(role, content) {
  const { text, image } = parts(content);
  const li = document.createElement("li");
  li.className = role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  li.append(who, body);
  if (image) {
    const img = document.createElement("img");
    img.className = "attached";
    img.src = image;
    img.alt = "attached image";
    li.insertBefore(img, body);
  }
  $("history").append(li);
  return li;
}

// The thought of an answer, folded above its text (created on its first words).
function thoughtOf(holder) {
  let text = holder.querySelector(".thought-text");
  if (!text) {
    const box = document.createElement("details");
    box.className = "thought";
    const summary = document.createElement("summary");
    summary.textContent = "Thought";
    text = document.createElement("span");
    text.className = "thought-text";
    box.append(summary, text);
    holder.insertBefore(box, holder.querySelector(".text"));
  }
  return text;
}

function addNote(element, text) {
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = ` (${text})`;
  element.append(note);
}

// Where this answer goes: a new assistant message (chat) or after the prompt (completion).
function answerTarget(prompt, content) {
  if (state.mode === "chat") {
    const turn = [addMessage("user", content), addMessage("assistant", "")];
    $("history").scrollTop = $("history").scrollHeight;
    return { text: turn[1].querySelector(".text"), holder: turn[1], turn };
  }
  const out = $("completion-out");
  const shown = document.createElement("span");
  shown.className = "prompt";
  shown.textContent = prompt;
  const text = document.createElement("span");
  text.className = "text";
  out.replaceChildren(shown, text);
  return { text, holder: out, turn: [] };
}

function record(event) {
  state.recording.push(event);
  view.apply(event);
}

async function send(event) {
  event?.preventDefault();
  const prompt = $("prompt").value;
  if (!state.model || state.controller || state.cancelReplay) return;
  if (!prompt.trim()) {
    showError("Write a prompt first.");
    return;
  }
  clearError();
  const chat = state.mode === "chat";
  const body = requestBody();
  const content = chat ? userContent(prompt) : prompt;
  if (chat) {
    const system = $("system").value.trim();
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history,
                     { role: "user", content }];
  } else {
    body.prompt = prompt;
  }
  const target = answerTarget(prompt, content);
  if (chat) $("prompt").value = "";  // back if the request is refused
  state.controller = new AbortController();
  state.recording = [];
  const t0 = performance.now();
  record({ kind: "start", t: t0, maxSteps: body.dgemma_sampling.max_denoising_steps });
  setState("running");
  let answer = "", usage = null;
  try {
    const path = chat ? "/v1/chat/completions" : "/v1/completions";
    for await (const chunk of client.stream(path, body, state.controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;
      if (choice.dgemma_draft) record({ kind: "draft", draft: choice.dgemma_draft, t: performance.now() });
      const thought = chat ? choice.delta?.reasoning_content : null;
      if (thought) thoughtOf(target.holder).textContent += thought;
      const delta = chat ? choice.delta?.content : choice.text;
      if (delta) {
        answer += delta;
        target.text.textContent = answer;
        record({ kind: "text", text: delta });
      }
    }
    record({ kind: "finish", usage, seconds: (performance.now() - t0) / 1000 });
    finishTurn(chat, content, answer);
    setState("done");
  } catch (e) {
    if (e.name === "AbortError") {
      record({ kind: "stopped" });
      addNote(target.holder, "stopped");
      finishTurn(chat, content, answer);
      setState("stopped");
    } else {
      if (answer) addNote(target.holder, "failed");
      else {
        target.turn.forEach((li) => li.remove());
        if (chat) $("prompt").value = prompt;
      }
      showError(e.readable || String(e));
      setState("error");
    }
  } finally {
    state.controller = null;
    setState(document.body.dataset.state);
  }
}

function finishTurn(chat, content, answer) {  // the image stays in the history: later turns see it too
  if (!chat) return;
  state.history.push({ role: "user", content }, { role: "assistant", content: answer });
  detach();
}

function stop() {
  if (state.controller) state.controller.abort();
  else if (state.cancelReplay) state.cancelReplay();
}

function replay() {
  if (!state.recording.length || state.controller || state.cancelReplay) return;
  setState("replaying");
  state.cancelReplay = view.replay(state.recording, $("speed").value, () => {
    state.cancelReplay = null;
    setState("done");
  });
}

function clearAll() {
  if (state.controller || state.cancelReplay) stop();
  state.history = [];
  state.recording = [];
  $("history").replaceChildren();
  $("completion-out").replaceChildren();
  detach();
  view.clear();
  clearError();
  setState(state.model ? "idle" : "locked");
}

// ---- tabs and keyboard -------------------------------------------------------------------------------------
function selectTab(mode, focus) {
  state.mode = mode;
  for (const m of ["chat", "completion"]) {
    const tab = $(`tab-${m}`), on = m === mode;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(`panel-${m}`).hidden = !on;
    if (on && focus) tab.focus();
  }
  $("prompt-label").textContent = mode === "chat" ? "Message" : "Prompt";
  $("attach").hidden = mode !== "chat";
}

function bind() {
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearAll);
  $("replay").addEventListener("click", replay);
  bindAttach();
  $("defaults").addEventListener("click", () => state.model && fillDefaults());
  $("tab-chat").addEventListener("click", () => selectTab("chat", false));
  $("tab-completion").addEventListener("click", () => selectTab("completion", false));
  for (const id of ["tab-chat", "tab-completion"]) {
    $(id).addEventListener("keydown", (e) => {
      const other = state.mode === "chat" ? "completion" : "chat";
      const to = { ArrowLeft: other, ArrowRight: other, Home: "chat", End: "completion" }[e.key];
      if (to) {
        e.preventDefault();
        selectTab(to, true);
      }
    });
  }
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") stop();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    client.key = $("api-key").value.trim();
    clearError();
    $("model-status").textContent = "checking the key…";
    loadModel();
  });
}

bind();
loadModel();
