// The 15 declarative step variants: their schemas as one union, and the planner that turns a list of steps into
// Dockerfile text and instructions, deterministically (same steps, same bytes).

import { Type } from "typebox";
import type { Static } from "typebox";
import { renderInstructions } from "../dockerfile.ts";
import type { Instruction, StepState } from "../dockerfile.ts";
import { RunStep, run } from "./run.ts";
import { EnvStep, env } from "./env.ts";
import { WorkdirStep, workdir } from "./workdir.ts";
import { UserStep, user } from "./user.ts";
import { CopyStep, copy } from "./copy.ts";
import { AptInstallStep, aptInstall } from "./apt-install.ts";
import { PipInstallStep, pipInstall } from "./pip-install.ts";
import { NpmInstallStep, npmInstall } from "./npm-install.ts";
import { GitCloneStep, gitClone } from "./git-clone.ts";
import { DownloadStep, download } from "./download.ts";
import { WriteFileStep, writeFile } from "./write-file.ts";
import { MkdirStep, mkdir } from "./mkdir.ts";
import { RemoveStep, remove } from "./remove.ts";
import { RenameStep, rename } from "./rename.ts";
import { SymlinkStep, symlink } from "./symlink.ts";
import type { PlannedStep } from "../backends/backend.ts";

export const Step = Type.Union([
  RunStep,
  EnvStep,
  WorkdirStep,
  UserStep,
  CopyStep,
  AptInstallStep,
  PipInstallStep,
  NpmInstallStep,
  GitCloneStep,
  DownloadStep,
  WriteFileStep,
  MkdirStep,
  RemoveStep,
  RenameStep,
  SymlinkStep,
]);
export type StepT = Static<typeof Step>;
export const STEP_TYPES = ["run", "env", "workdir", "user", "copy", "apt_install", "pip_install", "npm_install", "git_clone", "download", "write_file", "mkdir", "remove", "rename", "symlink"] as const;

/** Steps whose failure is likely a network fetch, so they are retried; everything else fails at once. */
const TRANSIENT = new Set<StepT["type"]>(["apt_install", "pip_install", "npm_install", "git_clone", "download"]);

export function stepInstructions(step: StepT, state: StepState): Instruction[] {
  switch (step.type) {
    case "run": return run(step, state);
    case "env": return env(step);
    case "workdir": return workdir(step);
    case "user": return user(step);
    case "copy": return copy(step);
    case "apt_install": return aptInstall(step, state);
    case "pip_install": return pipInstall(step);
    case "npm_install": return npmInstall(step);
    case "git_clone": return gitClone(step);
    case "download": return download(step);
    case "write_file": return writeFile(step);
    case "mkdir": return mkdir(step);
    case "remove": return remove(step);
    case "rename": return rename(step);
    case "symlink": return symlink(step);
  }
}

/** A short, human-readable target for log and cache entries (never includes file content or env values). */
export function describeStep(step: StepT): string {
  const clip = (s: string) => (s.length > 80 ? s.slice(0, 77) + "…" : s).replace(/[\x00-\x1f]/g, " ");
  switch (step.type) {
    case "run": return `run ${clip(step.command)}`;
    case "env": return `env ${Object.keys(step.envs).sort().join(" ")}`;
    case "workdir": return `workdir ${clip(step.path)}`;
    case "user": return `user ${step.user}`;
    case "copy": return `copy ${clip(step.src)} → ${clip(step.dest)}`;
    case "apt_install": case "pip_install": case "npm_install": return `${step.type} ${clip(step.packages.join(" "))}`;
    case "git_clone": return `git_clone ${clip(step.url)} → ${clip(step.dest)}`;
    case "download": return `download ${clip(step.url)} → ${clip(step.dest)}`;
    case "write_file": return `write_file ${clip(step.path)}`;
    case "mkdir": return `mkdir ${clip(step.path)}`;
    case "remove": return `remove ${clip(step.path)}`;
    case "rename": return `rename ${clip(step.src)} → ${clip(step.dest)}`;
    case "symlink": return `symlink ${clip(step.path)} → ${clip(step.target)}`;
  }
}

/** Plans every step: the user in force flows from one step to the next, starting at the source's user. */
export function planSteps(steps: StepT[], initialUser: string): PlannedStep[] {
  const state: StepState = { user: initialUser };
  return steps.map((step, i) => {
    const instructions = stepInstructions(step, state);
    for (const ins of instructions) if (ins.op === "USER") state.user = ins.user;
    return { index: i + 1, description: describeStep(step), instructions, text: renderInstructions(instructions), transient: TRANSIENT.has(step.type) };
  });
}
