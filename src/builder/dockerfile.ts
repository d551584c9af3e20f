// Declarative steps as Dockerfile text: the instruction model steps produce, its rendering with quoting no
// argument can break out of (RUN and COPY in JSON form; ENV/WORKDIR escaped), and the whole file's assembly.

import { createHash } from "node:crypto";

export type Instruction =
  | { op: "RUN"; script: string; /** A Dockerfile's build args in scope: environment under the image's ENV. */ envs?: [string, string][] }
  | { op: "ENV"; envs: [string, string][] }
  | { op: "WORKDIR"; path: string }
  | { op: "USER"; user: string }
  | { op: "COPY"; src: string; dest: string; mode?: string; owner?: string };

/** What a step's conversion may depend on besides the step: the user later instructions run as. */
export interface StepState {
  user: string;
}

/** POSIX shell single quoting: the only character needing care inside '…' is ' itself. */
export function shellQuote(s: string): string {
  return "'" + s.replaceAll("'", "'\\''") + "'";
}

/** Escapes a value for Dockerfile's double-quoted ENV and for WORKDIR (backslash, quote, variable expansion). */
function dockerEscape(s: string): string {
  return s.replace(/[\\"$]/g, (c) => "\\" + c);
}

export function renderInstruction(i: Instruction): string {
  switch (i.op) {
    case "RUN":
      // Exec form: no variable substitution by the builder, and JSON escaping keeps every byte on one line.
      return `RUN ${JSON.stringify(["/bin/sh", "-c", i.script])}`;
    case "ENV":
      return `ENV ${i.envs.map(([k, v]) => `${k}="${dockerEscape(v)}"`).join(" ")}`;
    case "WORKDIR":
      return `WORKDIR ${dockerEscape(i.path)}`;
    case "USER":
      return `USER ${i.user}`;
    case "COPY": {
      const flags = [i.mode ? `--chmod=${i.mode}` : "", i.owner ? `--chown=${i.owner}` : ""].filter(Boolean).join(" ");
      return `COPY ${flags ? flags + " " : ""}${JSON.stringify([i.src, i.dest])}`;
    }
  }
}

export function renderInstructions(list: Instruction[]): string {
  return list.map(renderInstruction).join("\n");
}

/** The whole Dockerfile: FROM the source, then each step's text in order. Same input, same bytes. */
export function assembleDockerfile(from: string, stepTexts: string[]): string {
  return [`FROM ${from}`, ...stepTexts].join("\n") + "\n";
}

export function sha256(text: string | Buffer): string {
  return "sha256:" + createHash("sha256").update(text).digest("hex");
}

/** Wraps instructions that must run as `user` so the user in force afterwards is unchanged. */
export function asUser(user: string, state: StepState, body: Instruction[]): Instruction[] {
  if (user === state.user) return body;
  return [{ op: "USER", user }, ...body, { op: "USER", user: state.user }];
}

/** `mkdir -p` of a path's parent, as a shell fragment (paths may be relative to the working directory). */
export function parentDirOf(path: string): string {
  return `mkdir -p "$(dirname -- ${shellQuote(path)})"`;
}
