// meterserve console: plain JavaScript, no framework, no build step, same origin only.
// Every figure shown comes from the server: a run's counters from its stream
// (stream_options.include_progress, then the final usage), the batch view from
// GET /v1/meterserve/live. Nothing is timed in the browser. docs/console.md explains it.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "meterserve-api-key";
  const SVG = "http://www.w3.org/2000/svg";
  const LIVE_INTERVAL_MS = 1000;

  const state = {
    requiresKey: false,
    key: sessionStorage.getItem(KEY_STORAGE),
    keyPrompt: null, // the pending askKey() promise, so a key is asked for once
    model: null,
    numParams: null, // N, from the live endpoint (meterserve_model_parameters)
    run: null, // the run in flight
  };

  // ---- the API ---------------------------------------------------------------------------

  /** fetch() on this origin with the API key; a 401 asks for the key and retries. */
  async function api(path, body, signal) {
    for (;;) {
      if (state.requiresKey && !state.key) await askKey();
      const headers = {};
      if (body !== undefined) headers["content-type"] = "application/json";
      if (state.key) headers.authorization = `Bearer ${state.key}`;
      const response = await fetch(path, {
        method: body === undefined ? "GET" : "POST",
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
        credentials: "same-origin",
      });
      if (response.status !== 401) return response;
      forgetKey();
      state.requiresKey = true;
    }
  }

  async function apiError(response) {
    let message = `HTTP ${response.status}`;
    try {
      const body = await response.json();
      if (body.error && body.error.message) message += `: ${body.error.message}`;
    } catch (_) {
      // not JSON: the status says enough
    }
    return new Error(message);
  }

  function askKey() {
    if (state.keyPrompt) return state.keyPrompt;
    state.keyPrompt = new Promise((resolve) => {
      const dialog = $("key-dialog");
      const form = $("key-form");
      const onSubmit = (event) => {
        event.preventDefault();
        const key = $("api-key").value.trim();
        if (!key) return;
        state.key = key;
        sessionStorage.setItem(KEY_STORAGE, key);
        $("forget-key").hidden = false;
        form.removeEventListener("submit", onSubmit);
        dialog.close();
        state.keyPrompt = null;
        resolve();
      };
      form.addEventListener("submit", onSubmit);
      dialog.showModal();
      $("api-key").focus();
    });
    return state.keyPrompt;
  }

  function forgetKey() {
    state.key = null;
    sessionStorage.removeItem(KEY_STORAGE);
    $("api-key").value = "";
    $("forget-key").hidden = true;
  }

  /** Server-sent events of one response: calls onChunk(json) per data line until [DONE]. */
  async function readStream(response, onChunk) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "stream error");
          onChunk(chunk);
        }
      }
    }
  }

  // ---- formatting ------------------------------------------------------------------------

  function si(value, unit) {
    if (value === null || value === undefined || !Number.isFinite(value)) return "–";
    const prefixes = ["", "k", "M", "G", "T", "P", "E"];
    let i = 0;
    let v = Math.abs(value);
    while (v >= 1000 && i < prefixes.length - 1) {
      v /= 1000;
      i += 1;
    }
    const digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
    return `${value < 0 ? "-" : ""}${v.toFixed(digits)} ${prefixes[i]}${unit}`.trim();
  }

  function seconds(value) {
    if (value === null || value === undefined) return "–";
    return value < 1 ? `${(value * 1000).toFixed(1)} ms` : `${value.toFixed(2)} s`;
  }

  function dollars(value) {
    if (value === null || value === undefined) return "–";
    if (value === 0) return "$0";
    return value >= 0.01 ? `$${value.toFixed(4)}` : `$${value.toExponential(3)}`;
  }

  function percent(value) {
    return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)} %`;
  }

  function setOutput(id, value, text) {
    const element = $(id);
    element.dataset.value = value === null || value === undefined ? "" : String(value);
    element.textContent = text;
  }

  // ---- a run -----------------------------------------------------------------------------

  function newRun(controller) {
    $("prompt-tokens").replaceChildren();
    $("answer-tokens").replaceChildren();
    return {
      controller,
      passes: new Map(), // forward_pass -> phase, this request's passes
      prefillPasses: 0,
      decodePasses: 0,
      decodeTokens: 0, // tokens decode passes produced (accepted drafts included)
      promptTokens: 0,
      completionTokens: 0,
      tokenTimes: [], // elapsed_seconds (server clock) of each pass that produced tokens
      batch: null,
      sawPrefill: false,
      prefillCost: 0,
      decodeCost: 0,
      prefillFlops: 0,
      decodeFlops: 0,
      usage: null,
    };
  }

  function renderPromptTokens(tokenStrings) {
    const box = $("prompt-tokens");
    const spans = tokenStrings.map((text, position) => {
      const span = document.createElement("span");
      span.className = "tok pending";
      span.textContent = text === "\n" ? "↵\n" : text;
      span.title = `position ${position}: waiting for its prefill pass`;
      return span;
    });
    box.replaceChildren(...spans);
  }

  function onProgress(run, p) {
    if (!run.passes.has(p.forward_pass)) {
      run.passes.set(p.forward_pass, p.phase);
      if (p.phase === "prefill") run.prefillPasses += 1;
      else run.decodePasses += 1;
    }
    run.batch = p.batch_size;
    run.promptTokens = p.prompt_tokens;
    if (p.phase === "prefill") lightPrompt(run, p);
    if (p.token_ids.length) {
      run.tokenTimes.push(p.elapsed_seconds);
      run.completionTokens += p.token_ids.length;
      if (p.phase === "decode") run.decodeTokens += p.token_ids.length;
    }
    run.prefillCost = p.prefill_cost_usd;
    run.decodeCost = p.decode_cost_usd;
    run.prefillFlops = p.prefill_flops;
    run.decodeFlops = p.decode_flops;
  }

  /** Light the prompt positions this prefill pass computed; before the first pass's start
   * they were prefix-cache hits. */
  function lightPrompt(run, p) {
    const spans = $("prompt-tokens").children;
    if (!run.sawPrefill) {
      run.sawPrefill = true;
      for (let i = 0; i < Math.min(p.start_position, spans.length); i++) {
        spans[i].className = "tok cached";
        spans[i].title = `position ${i}: prefix-cache hit (computed by an earlier request)`;
      }
    }
    const colour = (run.prefillPasses - 1) % 4;
    const end = Math.min(p.start_position + p.num_tokens, spans.length);
    for (let i = p.start_position; i < end; i++) {
      spans[i].className = `tok pass-${colour}`;
      spans[i].title =
        `position ${i}: forward pass ${p.forward_pass} (prefill chunk of ${p.num_tokens}, ` +
        `batch of ${p.batch_size}, at ${seconds(p.elapsed_seconds)})`;
    }
  }

  function addAnswerToken(p, text) {
    const span = document.createElement("span");
    span.className = p.phase === "prefill" ? "tok first" : "tok";
    span.textContent = text;
    const drafts = p.draft_tokens
      ? `, ${p.accepted_draft_tokens} of ${p.draft_tokens} draft tokens accepted`
      : "";
    span.title =
      `token ${p.token_ids.join(", ")}: forward pass ${p.forward_pass} (${p.phase}, ` +
      `batch of ${p.batch_size}${drafts}, at ${seconds(p.elapsed_seconds)})`;
    const box = $("answer-tokens");
    box.append(span);
    box.scrollTop = box.scrollHeight;
  }

  function onChunk(run, chunk, mode) {
    const progress = chunk.meterserve;
    if (progress) onProgress(run, progress);
    const choice = chunk.choices && chunk.choices[0];
    if (choice && progress && progress.token_ids.length) {
      const text = mode === "chat" ? (choice.delta && choice.delta.content) || "" : choice.text;
      addAnswerToken(progress, text || "");
    }
    if (chunk.usage) run.usage = chunk.usage;
    renderCounters(run);
  }

  function renderCounters(run) {
    const usage = run.usage; // once present, the settled bill replaces the running totals
    const times = run.tokenTimes;
    const first = times.length ? times[0] : null;
    const last = times.length ? times[times.length - 1] : null;
    const completion = usage ? usage.completion_tokens : run.completionTokens;
    const prompt = usage ? usage.prompt_tokens : run.promptTokens;
    const ttft = usage ? usage.time_to_first_token_seconds ?? null : first;
    const itl = times.length > 1 ? (last - first) / (times.length - 1) : null;
    const tps = last ? completion / last : null;
    setOutput("c-prefill-passes", run.prefillPasses, String(run.prefillPasses));
    setOutput("c-decode-passes", run.decodePasses, String(run.decodePasses));
    const total = run.prefillPasses + run.decodePasses;
    setOutput("c-forward-passes", total, String(total));
    const perPass = run.decodePasses ? run.decodeTokens / run.decodePasses : null;
    setOutput("c-tokens-per-pass", perPass, perPass === null ? "–" : perPass.toFixed(2));
    setOutput("c-prompt-tokens", prompt, String(prompt));
    setOutput("c-completion-tokens", completion, String(completion));
    setOutput("c-batch", run.batch, run.batch === null ? "–" : `${run.batch} request(s)`);
    setOutput("c-ttft", ttft, seconds(ttft));
    setOutput("c-itl", itl, seconds(itl));
    setOutput("c-tps", tps, tps === null ? "–" : `${tps.toFixed(1)} tok/s`);
    const prefillCost = usage ? usage.prefill_cost_usd : run.prefillCost;
    const decodeCost = usage ? usage.decode_cost_usd : run.decodeCost;
    const cost = usage ? usage.cost_usd : run.prefillCost + run.decodeCost;
    setOutput("c-cost-prefill", prefillCost, dollars(prefillCost));
    setOutput("c-cost-decode", decodeCost, dollars(decodeCost));
    setOutput("c-cost", cost, dollars(cost));
    const prefillFlops = usage ? usage.prefill_flops : run.prefillFlops;
    const decodeFlops = usage ? usage.decode_flops : run.decodeFlops;
    setOutput("c-flops-prefill", prefillFlops, flopsText(prefillFlops, prompt));
    setOutput("c-flops-decode", decodeFlops, flopsText(decodeFlops, completion));
  }

  /** FLOPs next to the seed's estimate 2N·tokens. */
  function flopsText(flops, numTokens) {
    if (state.numParams === null || !numTokens) return si(flops, "FLOP");
    const estimate = 2 * state.numParams * numTokens;
    return `${si(flops, "FLOP")} · 2N×${numTokens} = ${si(estimate, "FLOP")} (×${(
      flops / estimate
    ).toFixed(2)})`;
  }

  function setStatus(kind, text) {
    const status = $("run-status");
    status.dataset.state = kind;
    status.textContent = text;
  }

  function setRunning(running) {
    $("run").disabled = running;
    $("stop").disabled = !running;
  }

  async function run() {
    if (state.run) return;
    const prompt = $("prompt").value;
    if (!prompt.trim()) {
      setStatus("error", "Type a prompt first.");
      $("prompt").focus();
      return;
    }
    const mode = document.querySelector('input[name="mode"]:checked').value;
    const controller = new AbortController();
    const current = newRun(controller);
    state.run = current;
    setRunning(true);
    renderCounters(current);
    try {
      setStatus("running", "Tokenizing the prompt…");
      const messages = [{ role: "user", content: prompt }];
      const input = mode === "chat" ? { messages } : { prompt };
      const tokenized = await api("/tokenize", { ...input, return_token_strs: true }, controller.signal);
      if (!tokenized.ok) throw await apiError(tokenized);
      const tokens = await tokenized.json();
      renderPromptTokens(tokens.token_strs);
      current.promptTokens = tokens.count;
      renderCounters(current);
      const body = {
        ...input,
        max_tokens: parseInt($("max-tokens").value, 10) || 16,
        temperature: parseFloat($("temperature").value) || 0,
        ignore_eos: $("ignore-eos").checked,
        stream: true,
        stream_options: { include_usage: true, include_progress: true },
      };
      if (state.model) body.model = state.model;
      setStatus("running", "Waiting for the prefill pass…");
      const path = mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
      const response = await api(path, body, controller.signal);
      if (!response.ok) throw await apiError(response);
      await readStream(response, (chunk) => {
        onChunk(current, chunk, mode);
        if (!current.usage && current.completionTokens) {
          setStatus("running", `Decoding: ${current.completionTokens} token(s)…`);
        }
      });
      if (!current.usage) throw new Error("the stream ended without its usage");
      renderCounters(current);
      setStatus(
        "done",
        `Done: ${current.usage.completion_tokens} token(s) in ` +
          `${current.prefillPasses + current.decodePasses} forward passes, ` +
          `${dollars(current.usage.cost_usd)}.`,
      );
    } catch (error) {
      if (error.name === "AbortError") setStatus("stopped", "Stopped.");
      else setStatus("error", error.message);
    } finally {
      state.run = null;
      setRunning(false);
    }
  }

  // ---- the live batch view ---------------------------------------------------------------

  async function pollLive() {
    try {
      const response = await api("/v1/meterserve/live");
      if (response.ok) renderLive(await response.json());
      else $("live-age").textContent = `(unavailable: HTTP ${response.status})`;
    } catch (_) {
      $("live-age").textContent = "(server unreachable; retrying)";
    }
    setTimeout(pollLive, LIVE_INTERVAL_MS);
  }

  function renderLive(live) {
    state.numParams = live.model_parameters;
    $("model-params").textContent = `N = ${si(live.model_parameters, "")} parameters`;
    $("live-age").textContent = `(last ${live.window_seconds} s)`;
    const now = live.now;
    const minute = live.last_minute;
    const cap = now.max_num_seqs ? ` of ${now.max_num_seqs}` : "";
    setOutput("live-running", now.num_running, `${now.num_running}${cap}`);
    setOutput("live-waiting", now.num_waiting, String(now.num_waiting));
    setOutput("live-kv", now.kv_cache_usage, percent(now.kv_cache_usage));
    setOutput("live-mfu", minute.mfu, percent(minute.mfu));
    setOutput("live-mbu", minute.mbu, percent(minute.mbu));
    const tps = minute.generation_tokens_per_second;
    setOutput("live-tps", tps, `${tps.toFixed(1)}`);
    const costIn = minute.cost_usd_per_million_input_tokens;
    const costOut = minute.cost_usd_per_million_output_tokens;
    setOutput("live-cost-in", costIn, costIn === null ? "–" : `$${costIn.toFixed(4)}`);
    setOutput("live-cost-out", costOut, costOut === null ? "–" : `$${costOut.toFixed(4)}`);
    const series = live.series;
    drawChart($("chart-batch"), [
      { values: series.num_running, className: "running" },
      { values: series.num_waiting, className: "waiting" },
    ], null, (v) => String(Math.round(v)));
    drawChart($("chart-kv"), [{ values: series.kv_cache_usage, className: "kv" }], 1, percent);
    drawChart($("chart-util"), [
      { values: series.mfu, className: "mfu" },
      { values: series.mbu, className: "mbu" },
    ], null, percent);
    drawChart($("chart-tps"), [
      { values: series.generation_tokens_per_second, className: "output" },
      { values: series.prompt_tokens_computed_per_second, className: "prompt" },
    ], null, (v) => si(v, ""));
  }

  /** One SVG line chart, oldest second on the left; `fixedMax` or a round automatic scale. */
  function drawChart(svg, series, fixedMax, label) {
    const width = 600;
    const height = 120;
    const top = 18;
    const peak = Math.max(0, ...series.flatMap((s) => s.values));
    const max = fixedMax ?? roundUp(peak);
    const y = (v) => height - 2 - (height - top - 2) * Math.min(v / max, 1);
    const nodes = [];
    for (const fraction of [0, 0.5, 1]) {
      const line = document.createElementNS(SVG, "line");
      const at = y(fraction * max);
      line.setAttribute("x1", "0");
      line.setAttribute("x2", String(width));
      line.setAttribute("y1", String(at));
      line.setAttribute("y2", String(at));
      line.setAttribute("class", "grid");
      nodes.push(line);
    }
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", "4");
    text.setAttribute("y", "15");
    text.setAttribute("class", "axis");
    text.textContent = `max ${label(max)}`;
    nodes.push(text);
    for (const { values, className } of series) {
      const step = width / Math.max(values.length - 1, 1);
      const polyline = document.createElementNS(SVG, "polyline");
      polyline.setAttribute("points", values.map((v, i) => `${i * step},${y(v)}`).join(" "));
      polyline.setAttribute("class", className);
      nodes.push(polyline);
    }
    svg.replaceChildren(...nodes);
    const latest = series.map((s) => `${s.className} ${label(s.values[s.values.length - 1] ?? 0)}`);
    svg.setAttribute("aria-label", `${svg.dataset.title || ""}latest: ${latest.join(", ")}`);
  }

  function roundUp(value) {
    if (value <= 0) return 1;
    const magnitude = 10 ** Math.floor(Math.log10(value));
    for (const m of [1, 2, 5, 10]) if (value <= m * magnitude) return m * magnitude;
    return 10 * magnitude;
  }

  // ---- start -----------------------------------------------------------------------------

  async function loadModel() {
    for (;;) {
      try {
        const response = await api("/v1/models");
        if (response.ok) {
          const models = await response.json();
          state.model = models.data[0].id;
          $("model-name").textContent = state.model;
          return;
        }
      } catch (_) {
        // the server is restarting: try again
      }
      $("model-name").textContent = "(loading…)";
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }

  async function start() {
    for (const svg of document.querySelectorAll("svg.chart")) {
      svg.dataset.title = `${svg.getAttribute("aria-label")}; `;
    }
    $("run-form").addEventListener("submit", (event) => {
      event.preventDefault();
      run();
    });
    $("stop").addEventListener("click", () => state.run && state.run.controller.abort());
    $("forget-key").addEventListener("click", forgetKey);
    $("forget-key").hidden = !state.key;
    $("key-dialog").addEventListener("cancel", (event) => event.preventDefault());
    document.addEventListener("keydown", (event) => {
      if ($("key-dialog").open) return;
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        run();
      } else if (event.key === "Escape" && state.run) {
        state.run.controller.abort();
      }
    });
    const config = await (await fetch("/console/config.json")).json();
    state.requiresKey = config.requires_api_key;
    await loadModel();
    pollLive();
  }

  start();
})();
