// Turns one JavaScript cell into a script the kernel can run in its global scope: plain code as it is, code with
// top-level await as an async body whose declarations become globals and whose last expression is the result.

import { parse } from "acorn";
import type { Node as AcornNode, Statement, ModuleDeclaration, Pattern } from "acorn";

/** True when `node` awaits outside any function of its own (top-level await), so it must run as an async body. */
function awaitsAtTopLevel(node: unknown): boolean {
  if (!node || typeof node !== "object") return false;
  const n = node as { type?: string; await?: boolean };
  if (n.type === "AwaitExpression" || (n.type === "ForOfStatement" && n.await)) return true;
  if (n.type === "FunctionDeclaration" || n.type === "FunctionExpression" || n.type === "ArrowFunctionExpression" || n.type === "MethodDefinition" || n.type === "PropertyDefinition") return false;
  for (const v of Object.values(n)) {
    if (Array.isArray(v) ? v.some(awaitsAtTopLevel) : awaitsAtTopLevel(v)) return true;
  }
  return false;
}

function namesOf(p: Pattern | null | undefined, into: string[]) {
  if (!p) return;
  switch (p.type) {
    case "Identifier":
      into.push(p.name);
      break;
    case "ObjectPattern":
      for (const prop of p.properties) namesOf(prop.type === "RestElement" ? prop.argument : (prop.value as Pattern), into);
      break;
    case "ArrayPattern":
      for (const el of p.elements) namesOf(el as Pattern | null, into);
      break;
    case "RestElement":
      namesOf(p.argument, into);
      break;
    case "AssignmentPattern":
      namesOf(p.left, into);
      break;
  }
}

/**
 * Code with top-level await becomes `var <names>; (async () => { <body> })()`: declarations turn into assignments
 * to globals declared outside (so they outlive the cell, as in Node's REPL) and the last expression is returned.
 */
export function compileCell(code: string): { source: string; async: boolean } {
  let ast: { body: (Statement | ModuleDeclaration)[] };
  try {
    ast = parse(code, { ecmaVersion: "latest", sourceType: "script", allowAwaitOutsideFunction: true }) as unknown as typeof ast;
  } catch {
    return { source: code, async: false }; // the VM reports the syntax error with its own words
  }
  if (!ast.body.some(awaitsAtTopLevel)) return { source: code, async: false };
  const text = (n: AcornNode) => code.slice(n.start, n.end);
  const hoisted: string[] = [];
  const body = ast.body.map((stmt, i) => {
    if (stmt.type === "VariableDeclaration") {
      return stmt.declarations
        .map((d) => {
          namesOf(d.id, hoisted);
          return d.init ? `(${text(d.id)} = ${text(d.init)});` : "";
        })
        .join("\n");
    }
    if ((stmt.type === "FunctionDeclaration" || stmt.type === "ClassDeclaration") && stmt.id) {
      hoisted.push(stmt.id.name);
      return `${stmt.id.name} = ${text(stmt)};`;
    }
    if (i === ast.body.length - 1 && stmt.type === "ExpressionStatement") return `return (${text(stmt.expression)});`;
    return text(stmt);
  });
  const decl = hoisted.length ? `var ${[...new Set(hoisted)].join(", ")};\n` : "";
  return { source: `${decl}(async () => {\n${body.join("\n")}\n})()`, async: true };
}
