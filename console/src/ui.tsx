// Small pieces every view uses: loading a resource, ages and sizes, status badges, errors, empty states and a
// two-step confirm button (no blocking dialogs: keyboard and tests drive it like any button).

import type { ComponentChildren } from "preact";
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "./api.ts";

export interface Loaded<T> {
  data: T | undefined;
  error: Error | undefined;
  loading: boolean;
  reload(): void;
}

/** Runs `load` now, whenever `deps` change, on reload(), and every `everyMs` while the view is shown. */
export function useLoad<T>(load: (signal: AbortSignal) => Promise<T>, deps: unknown[], everyMs?: number): Loaded<T> {
  const [state, setState] = useState<{ data?: T; error?: Error; loading: boolean }>({ loading: true });
  const [tick, setTick] = useState(0);
  const reload = useCallback(() => setTick((t) => t + 1), []);
  useEffect(() => {
    const ctl = new AbortController();
    setState((s) => ({ ...s, loading: true }));
    load(ctl.signal).then(
      (data) => !ctl.signal.aborted && setState({ data, loading: false }),
      (error: Error) => !ctl.signal.aborted && setState((s) => ({ data: s.data, error, loading: false })),
    );
    const timer = everyMs ? setTimeout(reload, everyMs) : undefined;
    return () => {
      ctl.abort();
      clearTimeout(timer);
    };
  }, [...deps, tick]);
  return { data: state.data, error: state.error, loading: state.loading, reload };
}

export function age(iso: string | null | undefined, now = Date.now()): string {
  if (!iso) return "—";
  const s = Math.max(0, Math.round((now - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

export function until(iso: string | null | undefined): string {
  if (!iso) return "—";
  const s = Math.round((Date.parse(iso) - Date.now()) / 1000);
  return s <= 0 ? "now" : `in ${age(new Date(Date.now() - s * 1000).toISOString())}`;
}

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${i === 0 ? v : v.toFixed(1)} ${units[i]}`;
}

export function when(iso: string | null | undefined): string {
  return iso ? new Date(iso).toLocaleString() : "—";
}

export function Status({ value }: { value: string }) {
  return <span class={`status status-${value}`}>{value}</span>;
}

export function ErrorNote({ error }: { error: Error | undefined }) {
  if (!error) return null;
  const api = error instanceof ApiError ? error : undefined;
  return (
    <p class="error" role="alert">
      {error.message}
      {api?.code ? <span class="muted"> ({api.code}{api.requestId ? `, ${api.requestId}` : ""})</span> : null}
    </p>
  );
}

export function Empty({ title, children }: { title: string; children?: ComponentChildren }) {
  return (
    <div class="empty">
      <h3>{title}</h3>
      {children}
    </div>
  );
}

/** A destructive action: the first press asks, the second (within 4 s) does it. */
export function ConfirmButton({ label, confirm, onConfirm, disabled }: { label: string; confirm: string; onConfirm: () => Promise<unknown> | void; disabled?: boolean }) {
  const [armed, setArmed] = useState(false);
  const [busy, setBusy] = useState(false);
  const timer = useRef<ReturnType<typeof setTimeout> | undefined>(undefined);
  useEffect(() => () => clearTimeout(timer.current), []);
  const press = async () => {
    if (!armed) {
      setArmed(true);
      timer.current = setTimeout(() => setArmed(false), 4000);
      return;
    }
    clearTimeout(timer.current);
    setArmed(false);
    setBusy(true);
    try {
      await onConfirm();
    } finally {
      setBusy(false);
    }
  };
  return (
    <button type="button" class={armed ? "danger armed" : "danger"} disabled={disabled || busy} onClick={press}>
      {busy ? "…" : armed ? confirm : label}
    </button>
  );
}

/** Runs an action, keeping its error to show beside the control that started it. */
export function useAction(): [Error | undefined, (fn: () => Promise<unknown>) => Promise<void>, boolean] {
  const [error, setError] = useState<Error>();
  const [busy, setBusy] = useState(false);
  const run = useCallback(async (fn: () => Promise<unknown>) => {
    setError(undefined);
    setBusy(true);
    try {
      await fn();
    } catch (err) {
      setError(err as Error);
    } finally {
      setBusy(false);
    }
  }, []);
  return [error, run, busy];
}

export function Section({ title, actions, children }: { title: ComponentChildren; actions?: ComponentChildren; children: ComponentChildren }) {
  return (
    <section>
      <header class="section-head">
        <h2>{title}</h2>
        <div class="actions">{actions}</div>
      </header>
      {children}
    </section>
  );
}
