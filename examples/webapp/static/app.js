// The page's behaviour: add documents, ask, and read the answer's server-sent events
// (passages, then delta..., then done or error) from a streamed fetch.
const $ = (id) => document.getElementById(id);

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body || {}),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail || response.status));
  return data;
}

function showCount(n) {
  $("count").textContent = `${n} passage${n === 1 ? "" : "s"} indexed`;
  $("count").dataset.passages = n;
}

async function addDocuments(path, body) {
  for (const id of ["add", "sample"]) $(id).disabled = true;
  status("Indexing: the server computes each new passage's KV cache once...");
  try {
    const result = await post(path, body);
    showCount(result.passages);
    status(`Added ${result.added} new passage${result.added === 1 ? "" : "s"}.`);
    if (path === "/api/documents") $("documents").value = "";
    for (const q of result.questions || []) $("sample-questions").append(new Option(q));
  } catch (err) {
    status(`Could not add documents: ${err.message}`, true);
  } finally {
    for (const id of ["add", "sample"]) $(id).disabled = false;
  }
}

function showPassages(passages) {
  $("passages").replaceChildren(...passages.map((p) => {
    const li = document.createElement("li");
    const score = document.createElement("div");
    score.className = "score";
    score.textContent = `similarity ${p.score.toFixed(2)} · ${p.tokens} tokens · ${p.id}`;
    li.append(p.text, score);
    return li;
  }));
}

function showReadout(done, question) {
  const show = (v) => (v === null || v === undefined ? "–" : String(v));
  const reused = done.cached_tokens ?? done.reused_tokens;
  $("ttft").textContent = show(done.ttft_ms);
  $("reused").textContent = show(reused);
  $("prompt-tokens").textContent = show(done.prompt_tokens);
  $("prefilled").textContent = show(done.prefilled_tokens);
  $("readout-mode").textContent = show(done.mode);
  $("first-token").textContent = show(done.first_token_ms);
  const checks = Object.entries(done.shadow || {}).map(([mode, c]) => `${mode} ${c.agreed} of ${c.checks}`);
  $("shadow").textContent = checks.length ? ` · shadow checks, the same as full: ${checks.join(", ")}` : "";
  $("readout").hidden = false;
  const row = document.createElement("tr");
  for (const cell of [done.mode, show(done.ttft_ms), `${show(reused)} / ${show(done.prompt_tokens)}`, question]) {
    const td = document.createElement("td");
    td.textContent = cell;
    row.append(td);
  }
  $("history").prepend(row);
}

function handle(event, data, question) {
  if (event === "passages") showPassages(data.passages);
  else if (event === "delta") $("answer").textContent += data.text;
  else if (event === "done") showReadout(data, question);
  else if (event === "error") throw new Error(data.message);
}

async function ask() {
  const question = $("question").value.trim();
  if (!question) return;
  $("ask").disabled = true;
  $("answer").textContent = "";
  $("answer").dataset.state = "streaming";
  $("readout").hidden = true;
  $("passages").replaceChildren();
  status("");
  try {
    const response = await fetch("/api/ask", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ question, mode: $("mode").value, k: Number($("k").value) }),
    });
    if (!response.ok) {
      const data = await response.json().catch(() => ({}));
      throw new Error(typeof data.detail === "string" ? data.detail : `HTTP ${response.status}`);
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {  // one server-sent event: "event: NAME\ndata: JSON"
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        const event = lines.find((l) => l.startsWith("event:"))?.slice(6).trim();
        const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
        if (event && data) handle(event, JSON.parse(data), question);
      }
    }
    $("answer").dataset.state = "done";
  } catch (err) {
    $("answer").dataset.state = "error";
    status(`Could not answer: ${err.message}`, true);
  } finally {
    $("ask").disabled = false;
  }
}

$("add").addEventListener("click", () => {
  const text = $("documents").value;
  if (text.trim()) addDocuments("/api/documents", { text });
});
$("sample").addEventListener("click", () => addDocuments("/api/sample"));
$("ask").addEventListener("click", ask);
$("question").addEventListener("keydown", (e) => { if (e.key === "Enter") ask(); });
fetch("/api/documents").then((r) => r.json()).then((d) => {
  showCount(d.passages);
  $("sample").hidden = !d.sample;
});
