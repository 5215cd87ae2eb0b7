// The one place the dashboard talks to the service: fetch with the session's token, error shapes,
// a fetch-based server-sent-events reader (EventSource cannot send an Authorization header), and
// authenticated downloads.

const TOKEN_KEY = "ferry.token";

export class AuthError extends Error {
  constructor(message) { super(message); this.name = "AuthError"; }
}

export class UnreachableError extends Error {
  constructor(message) { super(message); this.name = "UnreachableError"; }
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.body = body;
  }
}

export function getToken() { return sessionStorage.getItem(TOKEN_KEY) || ""; }
export function setToken(token) { sessionStorage.setItem(TOKEN_KEY, token); }
export function forgetToken() { sessionStorage.removeItem(TOKEN_KEY); }

function authHeaders(extra = {}) {
  const token = getToken();
  return token ? { ...extra, Authorization: `Bearer ${token}` } : { ...extra };
}

// Listeners told whether the last request reached the server (for the header's connection badge).
const connectionListeners = new Set();
export function onConnection(listener) { connectionListeners.add(listener); }
function reportConnection(ok) { connectionListeners.forEach((listener) => listener(ok)); }

/** Fetch `path` from the service; resolves to parsed JSON (or text), throws one of the errors above. */
export async function api(path, { method = "GET", body, contentType, headers = {}, signal } = {}) {
  const init = { method, signal, headers: authHeaders(headers) };
  if (body !== undefined) {
    init.body = typeof body === "string" ? body : JSON.stringify(body);
    init.headers["Content-Type"] = contentType || (typeof body === "string" ? "application/yaml" : "application/json");
  }
  return send(path, init);
}

/**
 * `DELETE path`: answered 204 with no body, so there is nothing to read; errors raise as `api`'s do.
 */
export async function apiDelete(path) {
  await send(path, { method: "DELETE", headers: authHeaders({}) });
}

async function send(path, init) {
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    reportConnection(false);
    throw new UnreachableError("The Ferry service cannot be reached.");
  }
  reportConnection(true);
  const payload = await readBody(response);
  if (response.status === 401 || response.status === 403) {
    throw new AuthError(errorMessage(payload) || "This service needs a token.");
  }
  if (!response.ok) {
    throw new ApiError(response.status, errorMessage(payload) || `${response.status} ${response.statusText}`, payload);
  }
  return payload;
}

async function readBody(response) {
  const text = await response.text();
  if (!text) return null;
  try { return JSON.parse(text); } catch { return text; }
}

/**
 * The sentence of an error answer: the service's `{error: {code, message}}`, or the text of a body that is
 * not JSON (a proxy's page).
 * @param {ErrorBody} payload
 */
export function errorMessage(payload) {
  if (payload == null) return "";
  if (typeof payload === "string") return payload;
  return payload.error?.message ?? JSON.stringify(payload);
}

/**
 * Stream a job's events: `onEvent({id, type, data})` for each one. Reconnects on its own, sending
 * `Last-Event-ID` so nothing is missed or repeated. Returns a function that stops the stream.
 */
export function streamEvents(jobId, { after = 0, onEvent, onState = () => {}, onAuthError = () => {}, shouldReconnect = () => true }) {
  const controller = new AbortController();
  let lastEventId = after > 0 ? String(after) : null;  // start from the last event the page already has
  let retryMs = 1000;

  async function connect() {
    while (!controller.signal.aborted) {
      try {
        const headers = authHeaders({ Accept: "text/event-stream" });
        if (lastEventId !== null) headers["Last-Event-ID"] = lastEventId;
        const response = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/events/stream`,
          { headers, signal: controller.signal, cache: "no-store" });
        if (response.status === 401 || response.status === 403) { onAuthError(); return; }
        if (!response.ok || !response.body) throw new Error(`stream answered ${response.status}`);
        onState("live");
        retryMs = 1000;
        const ended = await readStream(response.body, (event) => {
          if (event.id !== null) lastEventId = event.id;
          if (event.retry) retryMs = event.retry;
          if (event.data !== null) onEvent(event);
        });
        if (ended === "closed") onState("ended");
      } catch (err) {
        if (controller.signal.aborted) return;
        onState("reconnecting");
      }
      if (!shouldReconnect()) { onState("ended"); return; }
      await sleep(retryMs, controller.signal);
    }
  }
  connect();
  return () => controller.abort();
}

async function readStream(body, emit) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = newEvent();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return "closed";
    buffer += value;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") { dispatch(event, emit); event = newEvent(); continue; }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") event.dataLines.push(value);
      else if (field === "event") event.type = value;
      else if (field === "id") event.id = value;
      else if (field === "retry" && /^\d+$/.test(value)) event.retry = Number(value);
    }
  }
}

function newEvent() { return { id: null, type: "message", dataLines: [], retry: null }; }

function dispatch(event, emit) {
  const raw = event.dataLines.length ? event.dataLines.join("\n") : null;
  let data = raw;
  if (raw !== null) { try { data = JSON.parse(raw); } catch { /* plain text data */ } }
  emit({ id: event.id, type: event.type, data, retry: event.retry });
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

/** A GET of `path` with the token; throws when the service cannot be reached or refuses the token. */
async function fetchWithToken(path, refusedMessage) {
  let response;
  try {
    response = await fetch(path, { headers: authHeaders() });
  } catch {
    throw new UnreachableError("The Ferry service cannot be reached.");
  }
  if (response.status === 401 || response.status === 403) throw new AuthError(refusedMessage);
  return response;
}

/** An object URL for an authenticated GET of ``path`` (an image an <img> cannot fetch with a header). */
export async function blobUrl(path) {
  const response = await fetchWithToken(path, "This image needs a token.");
  if (!response.ok) throw new ApiError(response.status, `image failed (${response.status})`);
  return URL.createObjectURL(await response.blob());
}

/** Download a file the service guards with the token: fetch it, then hand the bytes to the browser. */
export async function download(path, filename) {
  const response = await fetchWithToken(path, "This download needs a token.");
  if (!response.ok) throw new ApiError(response.status, errorMessage(await readBody(response)) || `download failed (${response.status})`);
  const url = URL.createObjectURL(await response.blob());
  const link = Object.assign(document.createElement("a"), { href: url, download: filename });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}
