// Live rendering of a template build's SSE stream for `kiln templates build`: step output as it happens and one
// progress line (step k/n, cache hits, elapsed) kept at the bottom of a terminal, or printed per step otherwise.

import type { LogEntry } from "../builder/log.ts";

export function createProgress(out: NodeJS.WriteStream, opts: { json: boolean }) {
  const started = Date.now();
  const tty = out.isTTY === true;
  let step = 0;
  let total = 0;
  let hits = 0;
  let lastPrinted = "";
  const bar = () => `[${total ? `step ${step}/${total}` : "preparing"} · cache hits ${hits} · ${((Date.now() - started) / 1000).toFixed(1)}s]`;
  const clear = () => tty && out.write("\r\x1b[2K");
  const timer = tty ? setInterval(() => (clear(), out.write(bar())), 250) : undefined;
  timer?.unref();

  function entry(e: LogEntry) {
    if (e.total_steps) total = e.total_steps;
    if (e.step_index) step = e.step_index;
    if (e.kind === "cache" && e.cache_outcome === "hit") hits++;
    if (opts.json) return void process.stdout.write(JSON.stringify(e) + "\n");
    clear();
    if (e.level !== "debug") {
      const prefix = e.kind === "message" && e.phase === "step" && !e.message.startsWith("step ") ? "  │ " : e.kind === "message" ? "" : `${e.kind}: `;
      out.write(`${prefix}${e.message}\n`);
    }
    if (tty) out.write(bar());
    else if (bar() !== lastPrinted && e.kind === "cache" && e.cache_layer === "layer") out.write((lastPrinted = bar()) + "\n");
  }

  function done() {
    if (timer) clearInterval(timer);
    clear();
    out.write(`${bar()}\n`);
  }

  return { entry, done };
}
