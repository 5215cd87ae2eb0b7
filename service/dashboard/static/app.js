// The dashboard shell: hash routes, the token gate, the connection badge and toasts.

import { AuthError, api, forgetToken, getToken, onConnection, setToken } from "./api.js";
import { h } from "./format.js";
import * as jobsPage from "./pages/jobs.js";
import * as jobPage from "./pages/job.js";
import * as submitPage from "./pages/submit.js";
import * as workersPage from "./pages/workers.js";

const view = document.getElementById("view");
let cleanup = () => {};

const ROUTES = [
  [/^#\/jobs\/([^/?]+)$/, jobPage, "jobs"],
  [/^#\/submit$/, submitPage, "submit"],
  [/^#\/workers$/, workersPage, "workers"],
  [/^#\/jobs$/, jobsPage, "jobs"],
];

function parseHash() {
  const hash = location.hash || "#/jobs";
  const [path, query = ""] = hash.split("?");
  for (const [pattern, page, nav] of ROUTES) {
    const match = path.match(pattern);
    if (match) return { page, nav, params: match.slice(1).map(decodeURIComponent), query: new URLSearchParams(query) };
  }
  return { page: jobsPage, nav: "jobs", params: [], query: new URLSearchParams(query) };
}

const ctx = {
  /** Called by a page when the service says 401: show the token gate instead of the page. */
  needToken(message) { showTokenGate(message); },
  toast,
  navigate(hash) { location.hash = hash; },
};

let routeSeq = 0;

async function route() {
  cleanup();
  cleanup = () => {};
  // Each visit renders into its own container: a page still loading when the user moves on writes
  // into a detached element, and its streams and timers stop as soon as its render returns.
  const seq = ++routeSeq;
  const { page, nav, params, query } = parseHash();
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", a.dataset.nav === nav));
  const container = h("div", { class: `page page-${nav}` });
  view.replaceChildren(container);
  window.scrollTo(0, 0);
  try {
    const stop = (await page.render(container, { params, query, ctx })) || (() => {});
    if (seq === routeSeq) cleanup = stop;
    else stop();
  } catch (err) {
    if (seq !== routeSeq) return;
    if (err instanceof AuthError) showTokenGate(err.message);
    else view.replaceChildren(h("div", { class: "banner error", role: "alert" }, h("strong", {}, "This page failed to load. "), String(err?.message || err)));
  }
}

function showTokenGate(message) {
  cleanup();
  cleanup = () => {};
  routeSeq += 1;  // whatever page was loading is superseded by the gate
  const hadToken = Boolean(getToken());
  forgetToken();
  updateTokenButton();
  const input = h("input", { type: "password", id: "token-input", name: "token", autocomplete: "current-password",
    placeholder: "Bearer token", required: true, "aria-label": "API token" });
  const form = h("form", { class: "card token-card", id: "token-form" },
    h("h1", {}, "This Ferry service needs a token"),
    h("p", { class: "muted" }, "Nothing is shown until the service accepts it. It is kept for this browser tab only ",
      "(session storage) and sent as ", h("code", {}, "Authorization: Bearer"), "."),
    hadToken ? h("p", { class: "form-error", role: "alert" }, message || "The token was refused.") : null,
    h("div", { class: "row" }, input, h("button", { class: "btn primary", type: "submit" }, "Continue")));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    setToken(input.value.trim());
    updateTokenButton();
    route();
  });
  view.replaceChildren(h("div", { class: "gate" }, form));
  input.focus();
}

function updateTokenButton() {
  document.getElementById("forget-token").hidden = !getToken();
}

function toast(message, kind = "info") {
  const el = h("div", { class: `toast ${kind}`, role: kind === "error" ? "alert" : "status" }, message);
  document.getElementById("toasts").append(el);
  setTimeout(() => el.classList.add("leaving"), 4500);
  setTimeout(() => el.remove(), 5000);
}

onConnection((ok) => {
  const badge = document.getElementById("conn");
  badge.hidden = ok;
  badge.textContent = ok ? "" : "Service unreachable — retrying";
  badge.className = ok ? "conn" : "conn down";
});

document.getElementById("forget-token").addEventListener("click", () => {
  forgetToken();
  updateTokenButton();
  route();
});

window.addEventListener("hashchange", route);
updateTokenButton();
route();

// Exposed for tests and the curious: the API helper with the session's token.
window.ferry = { api };
