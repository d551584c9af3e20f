// The page's CSP admits <style> elements only with this response's nonce. xterm.js makes its own <style> elements
// and has no nonce option, so every <style> the document creates is stamped with the nonce before it is inserted.
// Imported first by main.tsx, before anything can create a style element.

const holder = document.querySelector<HTMLStyleElement>("style[nonce]");
const nonce = holder?.nonce;
if (nonce) {
  const create = Document.prototype.createElement;
  Document.prototype.createElement = function (this: Document, tag: string, options?: ElementCreationOptions) {
    const el = create.call(this, tag, options);
    if (tag.toLowerCase() === "style") el.setAttribute("nonce", nonce);
    return el;
  } as typeof create;
}

export {};
