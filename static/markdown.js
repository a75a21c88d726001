// Markdown in the page, by the rules of app/ui/markdown.py (keep the two in step).
//
// render(text): a streaming reply's text as HTML, drawn four times a second while it streams, so that its
// paragraphs, lists, headings, quotes, tables and code look while they stream as they will once it ends,
// when Gradio renders the whole message with its own Markdown (marked, GitHub's flavour, a line break
// kept as one) and the reply does not jump. The common part of that Markdown, in a few small functions,
// from the text so far: a construct still open (a block of code without its closing fence, "**bold" not
// yet closed) is drawn as far as it goes. All text is escaped: markup in a reply is shown as text, as
// as_text has it shown in the end. Code is not highlighted until the reply ends. A browser test compares
// it with Gradio's rendering of the same text.
//
// unescapeOutsideCode(shown): app/ui/markdown.py's as_text undone, for the edit box and Copy message.
(() => {
  // A fence opens a block of code: three or more backticks or tildes at the start of a line (indented at
  // most three spaces), a language after it; the block ends at a line of the same character, at least as
  // many, or at the end of the text. A span of code: a run of backticks, text with no blank line in it, a
  // run of as many.
  const OPENING = /^ {0,3}(?:(`{3,})[^`\n]*|(~{3,})[^\n]*)$/;
  const SPAN = /(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n)[\s\S])+?)(?<!`)\1(?!`)/g;

  const closingOf = (fence) => new RegExp(`^ {0,3}${fence[0]}{${fence.length},}[ \\t]*$`);

  // as_text undone: blocks of code from a fence to a fence that closes it, or to the end, and spans of
  // code, as they are; the rest with `&lt;` and `&amp;` back to `<` and `&`
  const OPENINGS = new RegExp(OPENING.source, "gm");

  function unescapeOutsideCode(shown) {
    let out = "", at = 0, opening;
    OPENINGS.lastIndex = 0;
    while ((opening = OPENINGS.exec(shown))) {
      const fence = opening[1] || opening[2];
      const closing = new RegExp(closingOf(fence).source, "gm");
      closing.lastIndex = opening.index + opening[0].length;
      const found = closing.exec(shown);
      const end = found ? found.index + found[0].length : shown.length;
      out += unescapeProse(shown.slice(at, opening.index)) + shown.slice(opening.index, end);
      at = OPENINGS.lastIndex = end;
    }
    return out + unescapeProse(shown.slice(at));
  }

  function unescapeProse(prose) {
    const unescape = (text) => text.replace(/&(lt|amp);/g, (entity) => (entity === "&lt;" ? "<" : "&"));
    let out = "", at = 0;
    for (const span of prose.matchAll(SPAN)) {
      out += unescape(prose.slice(at, span.index)) + span[0];
      at = span.index + span[0].length;
    }
    return out + unescape(prose.slice(at));
  }

  const escape = (text) => text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;");

  // ---- inline: code spans, emphasis, strikethrough, links, line breaks

  // links: [text](address), and an http(s) address alone as GitHub's Markdown links it, without the
  // punctuation after it (the text is escaped: an address ends before "&lt;", "&gt;", "&quot;")
  const NO_ENTITY = String.raw`(?!&lt;|&gt;|&quot;)`;
  const LINK = new RegExp(String.raw`\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)`
    + String.raw`|\bhttps?:\/\/(?:${NO_ENTITY}[^\s<])*${NO_ENTITY}[^\s<.,:;'")\]*_~]`, "g");
  const linked = (whole, text, address) =>
    `<a href="${address || whole}" target="_blank" rel="noopener noreferrer">${text || whole}</a>`;

  // emphasis holding no delimiter of its kind first, then strong (which may hold it), then emphasis again
  // (which may hold strong): "*a **b** c*", "**a *b* c**"
  const EM = [/(?<![*\\])\*([^*\s](?:[^*]*[^*\s])?)\*(?!\*)/g, "<em>$1</em>"];
  const UNDER_EM = [/(?<![\w_])_([^_\s](?:[^_]*[^_\s])?)_(?![\w_])/g, "<em>$1</em>"];
  const EMPHASIS = [
    EM, UNDER_EM,
    // strong (and strikethrough) holds no delimiter of its own: each opening looks no further than the next
    // (a reply repeating "**a " would otherwise take time growing with its length squared)
    [/\*\*(?=\S)((?:(?!\*\*)[\s\S])*?\S)\*\*/g, "<strong>$1</strong>"],
    [/(?<![\w_])__(?=\S)((?:(?!__)[\s\S])*?\S)__(?![\w_])/g, "<strong>$1</strong>"],
    EM, UNDER_EM,
    [/~~(?=\S)((?:(?!~~)[\s\S])*?\S)~~/g, "<del>$1</del>"],
    [LINK, linked],
  ];

  function styled(text) {  // text: escaped already
    let out = text;
    for (const [pattern, replacement] of EMPHASIS) out = out.replace(pattern, replacement);
    return out;
  }

  // spans of code are set aside (a mark in their place) while the rest is styled, so that emphasis may hold
  // them: "**use `x` now**"
  function inline(text) {
    const spans = [];
    const marked = text.replace(/\u0000/g, "").replace(SPAN, (whole, ticks, body) => {
      let code = body.replace(/\n/g, " ");
      if (/^ [\s\S]*[^ ][\s\S]* $/.test(code)) code = code.slice(1, -1);  // one space each side: dropped
      spans.push(`<code>${escape(code)}</code>`);
      return `\u0000${spans.length - 1}\u0000`;
    });
    return styled(escape(marked))
      .replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)])
      .replace(/ *\\?\n/g, "<br>");  // a line break kept as one
  }

  // ---- blocks: each kind tried in turn at the start of a line (BLOCKS), else a paragraph

  const BLANK = /^[ \t]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( {0,3})([-*+]|(\d{1,9})[.)])(?:[ \t]+(.*))?$/;
  const TASK = /^\[([ xX])\][ \t]+/;
  const UNDERLINE = /^ {0,3}(=+|-+)[ \t]*$/;  // under a paragraph: it was a heading
  const DELIMITER = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;

  // A block's copy button, as Gradio draws it on a finished message's code; the copy action Gradio sets on
  // each message copies the block's text and shows the check. Only on a block that is closed: the rest of
  // an open one is still coming.
  const COPY_BUTTON = '<button title="copy" class="copy_code_button"><span class="copy-text">'
    + '<svg xmlns="http://www.w3.org/2000/svg" color="currentColor" stroke-width="1.3" width="15" height="15">'
    + '<path fill="currentColor" d="M12.728 4.545v8.182H4.545V4.545zm0 -0.909H4.545a0.909 0.909 0 0 0 -0.909 '
    + '0.909v8.182a0.909 0.909 0 0 0 0.909 0.909h8.182a0.909 0.909 0 0 0 0.909 -0.909V4.545a0.909 0.909 0 0 0 '
    + '-0.909 -0.909"></path><path fill="currentColor" d="M1.818 8.182H0.909V1.818a0.909 0.909 0 0 1 0.909 '
    + '-0.909h6.364v0.909H1.818Z"></path></svg></span><span class="check"><svg xmlns="http://www.w3.org/2000/svg" '
    + 'width="17" height="17" fill="none" stroke="currentColor" stroke-width="1.3">'
    + '<path d="m13.813 4.781 -7.438 7.438 -3.188 -3.188"></path></svg></span></button>';

  function code(lines, at) {
    const opening = lines[at].match(OPENING);
    if (!opening) return null;
    const fence = opening[1] || opening[2], closing = closingOf(fence);
    const language = lines[at].trim().slice(fence.length).trim().split(/\s+/)[0];
    const indent = lines[at].match(/^ */)[0].length, body = [];
    let end = at + 1;
    for (; end < lines.length && !closing.test(lines[end]); end++) {
      body.push(lines[end].replace(new RegExp(`^ {0,${indent}}`), ""));
    }
    const named = language ? ` class="language-${escape(language)}"` : "";
    const text = body.map((line) => `${line}\n`).join(""), button = end < lines.length ? COPY_BUTTON : "";
    return {html: `<div class="code_wrap">${button}<pre><code${named}>${escape(text)}</code></pre></div>`,
            next: end + 1};
  }

  function indentedCode(lines, at) {
    if (!/^( {4}|\t)/.test(lines[at]) || BLANK.test(lines[at])) return null;
    let end = at;
    while (end < lines.length && (/^( {4}|\t)/.test(lines[end]) || BLANK.test(lines[end]))) end++;
    while (BLANK.test(lines[end - 1])) end--;
    const text = lines.slice(at, end).map((line) => `${line.replace(/^( {4}|\t)/, "")}\n`).join("");
    const button = end < lines.length ? COPY_BUTTON : "";  // closed by the line after it
    return {html: `<div class="code_wrap">${button}<pre><code>${escape(text)}</code></pre></div>`, next: end};
  }

  function heading(lines, at) {
    const found = lines[at].match(HEADING);
    if (!found) return null;
    const level = found[1].length;
    return {html: `<h${level}>${inline(found[2] || "")}</h${level}>`, next: at + 1};
  }

  function rule(lines, at) {
    return RULE.test(lines[at]) ? {html: "<hr>", next: at + 1} : null;
  }

  function quote(lines, at) {
    if (depth > MAX_DEPTH || !QUOTE.test(lines[at])) return null;
    const inner = [];
    let end = at;
    for (; end < lines.length && !BLANK.test(lines[end]); end++) {
      const quoted = lines[end].match(QUOTE);
      if (!quoted && startsBlock(lines, end)) break;
      inner.push(quoted ? quoted[1] : lines[end]);  // a line without ">" continues the quote's paragraph
    }
    return {html: `<blockquote>\n${blocks(inner)}</blockquote>`, next: end};
  }

  // a list: its items, each its first line and the lines indented under it; a blank line between items or
  // in one makes the list loose (each item's text a paragraph)
  function list(lines, at) {
    const first = depth > MAX_DEPTH ? null : lines[at].match(ITEM);
    if (!first) return null;
    const ordered = first[3] !== undefined, marker = first[2].slice(-1);
    const sameList = (found) => found && (ordered ? found[3] !== undefined && found[2].slice(-1) === marker
                                                  : found[2] === first[2]);
    const items = [];
    let end = at, loose = false;
    while (end < lines.length) {
      const found = lines[end].match(ITEM);
      if (!sameList(found)) break;
      const width = found[1].length + found[2].length + 1, body = [found[4] || ""];
      end++;
      while (end < lines.length) {
        const line = lines[end];
        if (BLANK.test(line)) {
          const after = end + 1 < lines.length ? lines[end + 1] : "";
          if (new RegExp(`^ {${width}}`).test(after)) {  // the item goes on after a blank line
            body.push("");
            loose = true;
            end++;
            continue;
          }
          if (sameList(after.match(ITEM))) { loose = true; end++; }
          break;
        }
        const indented = new RegExp(`^ {${Math.min(width, 4)}}`).test(line);
        if (!indented && (startsBlock(lines, end) || ITEM.test(line))) break;
        body.push(line.replace(new RegExp(`^ {0,${width}}`), ""));
        end++;
      }
      items.push(body);
      if (end >= lines.length || !sameList((lines[end] || "").match(ITEM))) break;
    }
    const tag = ordered ? "ol" : "ul";
    const start = ordered && Number(first[3]) !== 1 ? ` start="${Number(first[3])}"` : "";
    const html = items.map(([lead, ...rest]) => {
      const task = lead.match(TASK);  // "[ ] " or "[x] ": a checkbox
      let inner = blocks([task ? lead.slice(task[0].length) : lead, ...rest]);
      if (!loose) inner = inner.replace(/^<p>([\s\S]*?)<\/p>\n?/, "$1");
      if (task) {
        const box = `<input type="checkbox" disabled${task[1] === " " ? "" : " checked"}> `;
        inner = loose ? inner.replace(/^<p>/, `<p>${box}`) : box + inner;
      }
      return `<li>${inner.trimEnd()}</li>\n`;
    }).join("");
    return {html: `<${tag}${start}>\n${html}</${tag}>`, next: end};
  }

  function cells(line) {
    return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((cell) => cell.trim());
  }

  function table(lines, at) {
    if (at + 1 >= lines.length || !lines[at].includes("|") || !DELIMITER.test(lines[at + 1])) return null;
    const head = cells(lines[at]), aligns = cells(lines[at + 1]).map((cell) =>
      cell.startsWith(":") && cell.endsWith(":") ? "center" : cell.endsWith(":") ? "right"
        : cell.startsWith(":") ? "left" : null);
    if (head.length !== aligns.length) return null;
    const row = (values, tag) => `<tr>\n${head.map((_, i) => {
      const align = aligns[i] ? ` align="${aligns[i]}"` : "";
      return `<${tag}${align}>${inline(values[i] || "")}</${tag}>\n`;
    }).join("")}</tr>\n`;
    let end = at + 2;
    const body = [];
    for (; end < lines.length && !BLANK.test(lines[end]) && !startsBlock(lines, end, table); end++) {
      body.push(row(cells(lines[end]), "td"));
    }
    const rows = body.length ? `<tbody>${body.join("")}</tbody>` : "";
    return {html: `<table>\n<thead>\n${row(head, "th")}</thead>\n${rows}</table>`, next: end};
  }

  const BLOCKS = [code, indentedCode, heading, rule, quote, list, table];

  // whether the line starts a block other than a paragraph (and so ends the paragraph before it): a list
  // item does when it is a bullet with text or an ordered one starting at 1
  function startsBlock(lines, at, except = null) {
    const line = lines[at], item = line.match(ITEM);
    if (item) return Boolean(item[4]) && (item[3] === undefined || Number(item[3]) === 1);
    return OPENING.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
      || (except !== table && table(lines, at) !== null);
  }

  function paragraph(lines, at) {
    let end = at + 1;
    while (end < lines.length && !BLANK.test(lines[end])) {
      const underline = lines[end].match(UNDERLINE);
      if (underline) {
        const level = underline[1][0] === "=" ? 1 : 2, text = lines.slice(at, end).map((l) => l.trim());
        return {html: `<h${level}>${inline(text.join("\n"))}</h${level}>`, next: end + 1};
      }
      if (startsBlock(lines, end)) break;
      end++;
    }
    const text = lines.slice(at, end).map((line) => line.trim()).join("\n");
    return {html: `<p>${inline(text)}</p>`, next: end};
  }

  // Quotes and lists hold blocks: nested deeper than MAX_DEPTH (a reply that repeats "> " or "- " along a
  // line), the rest is drawn as paragraphs, so that no reply can take the page's stack
  const MAX_DEPTH = 16;
  let depth = 0;

  function blocks(lines) {
    const out = [];
    depth++;
    try {
      for (let at = 0; at < lines.length;) {
        if (BLANK.test(lines[at])) {
          at++;
          continue;
        }
        let found = null;
        for (const block of BLOCKS) if ((found = block(lines, at))) break;
        found = found || paragraph(lines, at);
        out.push(found.html);
        at = found.next;
      }
    } finally {
      depth--;
    }
    return out.map((html) => `${html}\n`).join("");
  }

  function render(text) {
    return blocks(text.replace(/\r\n?/g, "\n").split("\n"));
  }

  window.phasescopeMarkdown = {render, unescapeOutsideCode};
})();
