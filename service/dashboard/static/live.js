// Polling that stops when the page goes away, backs off while the server is down, and hands auth
// failures to the token gate.

import { AuthError, UnreachableError } from "./api.js";

export const POLL_MS = 1500;

/**
 * Call `load()` now and every `intervalMs` after it settles. `onError(err)` sees failures other than
 * auth; a 401 goes to `ctx.needToken`. Returns a stop function.
 */
export function poll(load, { intervalMs = POLL_MS, onError = () => {}, ctx }) {
  let stopped = false;
  let timer = null;
  let failures = 0;
  async function tick() {
    if (stopped) return;
    try {
      await load();
      failures = 0;
    } catch (err) {
      if (stopped) return;
      if (err instanceof AuthError) { stopped = true; ctx.needToken(err.message); return; }
      failures += 1;
      onError(err);
    }
    if (stopped) return;
    // Back off to at most 10 s while the server is unreachable.
    const wait = failures ? Math.min(10_000, intervalMs * 2 ** Math.min(failures, 3)) : intervalMs;
    timer = setTimeout(tick, document.hidden ? Math.max(wait, 5000) : wait);
  }
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

export function describeError(err) {
  if (err instanceof UnreachableError) return "The Ferry service cannot be reached. Retrying…";
  return err?.message || String(err);
}
