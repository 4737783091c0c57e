// tinyserve's chat page: streams answers from this server's /v1/chat/completions (SSE, read with
// fetch + ReadableStream), keeps conversations and settings in localStorage and the API key, when
// the server needs one, in sessionStorage (this tab only). Model text is HTML-escaped before the
// small markdown renderer adds its own tags, so an answer can never inject markup; the server's
// Content-Security-Policy allows no inline script besides.

const $ = (id) => document.getElementById(id);
const CHATS = "tinyserve.chats";
const CURRENT = "tinyserve.current";
const SETTINGS = "tinyserve.settings";
const KEY = "tinyserve.key";
const SAMPLING = ["temperature", "top_p", "max_tokens", "seed"]; // numbers; empty: server default

let chats = load(CHATS, []); // [{id, title, messages: [{role, content, stats?, stopped?, error?}]}]
let currentId = localStorage.getItem(CURRENT);
let settings = load(SETTINGS, {}); // {system, temperature, top_p, max_tokens, seed} as typed
let model = null; // the first entry of /v1/models
let controller = null; // the AbortController of the answer streaming now
let images = []; // data: URLs attached to the next message (see takesImages)

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(CHATS, JSON.stringify(chats));
    localStorage.setItem(CURRENT, currentId ?? "");
  } catch (e) {
    $("status").textContent = `Not saved: ${e.message}`; // the quota: delete old chats
  }
}

// -- markdown: escape everything first, then add a few tags of our own ----------------------------

function escapeHtml(text) {
  const map = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return text.replace(/[&<>"']/g, (c) => map[c]);
}

function inline(text) {
  // odd parts are `code` spans, left as they are; the rest gets **bold** and *italic*
  return text
    .split(/(`[^`]+`)/)
    .map((part, i) =>
      i % 2
        ? `<code>${part.slice(1, -1)}</code>`
        : part
            .replace(/\*\*(\S(?:.*?\S)?)\*\*/g, "<strong>$1</strong>")
            .replace(/\*(\S(?:.*?\S)?)\*/g, "<em>$1</em>"), // not "2 * 3 * 4"
    )
    .join("");
}

export function markdown(text) {
  let html = "";
  let para = [];
  let list = null; // {tag: "ul" | "ol", items}
  let code = null; // the lines of an open ``` block (one still streaming may never close)
  const flush = () => {
    if (para.length) html += `<p>${inline(para.join("<br>"))}</p>`;
    if (list) {
      const items = list.items.map((item) => `<li>${inline(item)}</li>`).join("");
      html += `<${list.tag}>${items}</${list.tag}>`;
    }
    para = [];
    list = null;
  };
  for (const line of escapeHtml(text).split("\n")) {
    let m;
    if (code !== null) {
      if (line.startsWith("```")) {
        html += `<pre><code>${code.join("\n")}</code></pre>`;
        code = null;
      } else code.push(line);
    } else if (line.startsWith("```")) {
      flush();
      code = [];
    } else if ((m = /^(#{1,6}) (.*)/.exec(line))) {
      flush();
      html += `<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`;
    } else if ((m = /^\s*(?:[-*+]|(\d+)[.)]) (.*)/.exec(line))) {
      const tag = m[1] ? "ol" : "ul";
      if (para.length || list?.tag !== tag) flush();
      list ??= { tag, items: [] };
      list.items.push(m[2]);
    } else if (!line.trim()) {
      flush();
    } else {
      if (list) flush();
      para.push(line);
    }
  }
  if (code !== null) html += `<pre><code>${code.join("\n")}</code></pre>`;
  flush();
  return html;
}

// -- the API --------------------------------------------------------------------------------------

async function api(path, init = {}) {
  const key = sessionStorage.getItem(KEY);
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = `Bearer ${key}`;
  const resp = await fetch(path, { ...init, headers });
  if (resp.status === 401) {
    sessionStorage.removeItem(KEY);
    $("key-dialog").showModal();
    throw new Error("This server needs its API key.");
  }
  if (!resp.ok) {
    const body = await resp.json().catch(() => null);
    throw new Error(body?.error?.message ?? `HTTP ${resp.status}`);
  }
  return resp;
}

async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data: "));
      buffer = buffer.slice(end + 2);
      const payload = data.map((l) => l.slice(6)).join("\n");
      if (payload === "[DONE]") return;
      if (payload) yield JSON.parse(payload);
    }
  }
}

async function loadModel() {
  try {
    model = (await (await api("/v1/models")).json()).data[0];
    $("model").textContent = model.id;
    $("status").textContent = "";
  } catch (e) {
    $("status").textContent = e.message;
  }
}

// The hook for images: attach them once the served model takes them (the vision issue), e.g.
// when /v1/models says so. They go out as OpenAI content parts (userContent).
function takesImages() {
  return false;
}

function userContent(text) {
  if (!images.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  images = [];
  return [{ type: "text", text }, ...parts];
}

function requestBody(chat) {
  const messages = chat.messages
    .filter((m) => m.content !== "")
    .map(({ role, content }) => ({ role, content }));
  if (settings.system) messages.unshift({ role: "system", content: settings.system });
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (model) body.model = model.id;
  for (const name of SAMPLING) if (settings[name]) body[name] = Number(settings[name]);
  return body;
}

async function send(text) {
  const chat = current() ?? newChat();
  if (!chat.messages.length) chat.title = text.slice(0, 40);
  chat.messages.push({ role: "user", content: userContent(text) });
  const body = requestBody(chat);
  const answer = { role: "assistant", content: "" };
  chat.messages.push(answer);
  save();
  render();
  const el = $("messages").lastElementChild;
  controller = new AbortController();
  setBusy(true);
  const start = performance.now();
  let first = null;
  let usage = null;
  try {
    const init = { method: "POST", body: JSON.stringify(body), signal: controller.signal };
    for await (const event of sseEvents((await api("/v1/chat/completions", init)).body)) {
      if (event.error) throw new Error(event.error.message);
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        answer.content += delta;
        update(el, answer);
      }
      if (event.usage) usage = event.usage;
    }
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = e.message;
  } finally {
    answer.stats = stats(start, first, performance.now(), usage);
    controller = null;
    setBusy(false);
    save();
    update(el, answer);
  }
}

function stats(start, first, end, usage) {
  const out = { ttftMs: first === null ? null : Math.round(first - start) };
  if (usage) {
    const n = usage.completion_tokens;
    out.completionTokens = n;
    out.promptTokens = usage.prompt_tokens;
    out.cachedTokens = usage.prompt_tokens_details?.cached_tokens ?? 0;
    if (n > 1 && end > first) out.tokensPerS = (n - 1) / ((end - first) / 1000); // after the first
  }
  return out;
}

function statsText(msg) {
  const s = msg.stats ?? {};
  const parts = [];
  if (s.tokensPerS !== undefined) parts.push(`${s.tokensPerS.toFixed(1)} tokens/s`);
  if (s.ttftMs !== null && s.ttftMs !== undefined) parts.push(`first token ${s.ttftMs} ms`);
  if (s.completionTokens !== undefined) parts.push(`${s.completionTokens} tokens`);
  if (s.cachedTokens !== undefined) parts.push(`cached ${s.cachedTokens}/${s.promptTokens} prompt`);
  if (msg.stopped) parts.push("stopped");
  if (msg.error) parts.push(`error: ${msg.error}`);
  return parts.join(" · ");
}

// -- the view -------------------------------------------------------------------------------------

function current() {
  return chats.find((c) => c.id === currentId);
}

function newChat() {
  // Not crypto.randomUUID: a page served over http off localhost is not a secure context.
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2);
  const chat = { id, title: "New chat", messages: [] };
  chats.unshift(chat);
  currentId = chat.id;
  return chat;
}

function textOf(content) {
  if (typeof content === "string") return content;
  const text = content.find((p) => p.type === "text")?.text ?? "";
  return `${text} [${content.length - 1} image(s)]`;
}

function update(el, msg) {
  const body = el.querySelector(".body");
  if (msg.role === "assistant") body.innerHTML = markdown(msg.content);
  else body.textContent = textOf(msg.content);
  el.querySelector(".stats").textContent = statsText(msg);
  const box = $("messages");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
}

function render() {
  const list = $("chats");
  list.replaceChildren();
  for (const chat of chats) {
    const li = document.createElement("li");
    const title = document.createElement("span");
    title.textContent = chat.title;
    li.className = chat.id === currentId ? "active" : "";
    li.onclick = () => {
      if (controller) return;
      currentId = chat.id;
      save();
      render();
    };
    const del = document.createElement("button");
    del.textContent = "×";
    del.title = "Delete this chat";
    del.onclick = (e) => {
      e.stopPropagation();
      if (controller) return;
      chats = chats.filter((c) => c !== chat);
      save();
      render();
    };
    li.append(title, del);
    list.append(li);
  }
  const box = $("messages");
  box.replaceChildren();
  for (const msg of current()?.messages ?? []) {
    const el = document.createElement("div");
    el.className = `message ${msg.role}`;
    el.innerHTML = '<div class="body"></div><div class="stats"></div>';
    box.append(el);
    update(el, msg);
  }
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// -- wiring ---------------------------------------------------------------------------------------

$("composer").onsubmit = (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
};
$("prompt").onkeydown = (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) $("composer").requestSubmit();
  if (e.key === "Enter" && !e.shiftKey) e.preventDefault();
};
$("stop").onclick = () => controller?.abort();
$("new-chat").onclick = () => {
  if (controller) return;
  newChat();
  save();
  render();
  $("prompt").focus();
};

const settingsForm = $("settings").querySelector("form");
$("open-settings").onclick = () => {
  for (const el of settingsForm.elements) if (el.name) el.value = settings[el.name] ?? "";
  $("settings").returnValue = ""; // Escape closes it without a value: nothing is saved
  $("settings").showModal();
};
$("settings").onclose = () => {
  if ($("settings").returnValue !== "save") return;
  for (const el of settingsForm.elements) if (el.name) settings[el.name] = el.value;
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
};
$("key-dialog").onclose = () => {
  const input = $("key-dialog").querySelector("input");
  if ($("key-dialog").returnValue === "save" && input.value) {
    sessionStorage.setItem(KEY, input.value);
    input.value = "";
    loadModel();
  }
};

$("attach").hidden = !takesImages();
$("attach").onclick = () => $("image-input").click();
$("image-input").onchange = async (e) => {
  for (const file of e.target.files) {
    images.push(
      await new Promise((resolve) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.readAsDataURL(file);
      }),
    );
  }
  $("status").textContent = `${images.length} image(s) attached`;
};

render();
loadModel();
