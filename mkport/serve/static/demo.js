// The demo page of mkport serve: POST /v1/audio/speech with response_format=pcm, read the streamed body
// chunk by chunk and schedule each chunk on the Web Audio clock right after the previous one, so playback
// starts with the first chunk. Stop aborts the request (the server cancels the stream) and the audio scheduled.
// Same-origin requests only; no external assets.
"use strict";

const $ = (id) => document.getElementById(id);
let sampleRate = 24000;
let audio = null;  // one AudioContext, made on the first click (browsers allow sound only after a gesture)
let request = null;  // the AbortController of the request in flight
let sources = [];  // the chunks scheduled and not yet played

function stop() {
  if (request) request.abort();
  for (const source of sources) source.stop();
  sources = [];
  $("stop").disabled = true;
}

// Stop stays enabled while a request runs or its audio plays.
function played(source) {
  sources = sources.filter((s) => s !== source);
  if (sources.length === 0 && request === null) $("stop").disabled = true;
}

function setStatus(message, isError = false) {
  $("status").textContent = message;
  $("status").className = isError ? "error" : "";
}

function fillSelect(select, values, chosen) {
  select.replaceChildren(...values.map((v) => new Option(v, v, false, v === chosen)));
  select.disabled = values.length === 0;
}

async function loadModel() {
  const r = await fetch("/v1/models");
  const body = await r.json();
  if (!r.ok) {
    setStatus(body.error.message + " (reload the page when it is ready)", true);
    return;
  }
  const m = body.data[0];
  sampleRate = m.sample_rate;
  $("model").textContent = `${m.id}, ${m.sample_rate} Hz`;
  $("notice").hidden = !m.random_weights;
  fillSelect($("voice"), m.voices, m.default_voice);
  fillSelect($("language"), m.languages, "auto");
  $("play").disabled = false;
}

// int16 little-endian PCM -> float samples; an odd trailing byte waits for the next chunk.
function toSamples(bytes) {
  const even = bytes.length - (bytes.length % 2);
  const view = new DataView(bytes.buffer, bytes.byteOffset, even);
  const out = new Float32Array(even / 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
  return [out, bytes.subarray(even)];
}

function addRow(cells) {
  const row = $("history").tBodies[0].insertRow(0);
  for (const c of cells) row.insertCell().textContent = c;
}

async function play() {
  $("play").disabled = true;
  $("stop").disabled = false;
  request = new AbortController();
  const text = $("text").value;
  const body = { input: text, response_format: "pcm", language: $("language").value, seed: Number($("seed").value) };
  if ($("voice").value) body.voice = $("voice").value;
  if ($("max-frames").value) body.max_frames = Number($("max-frames").value);
  for (const id of ["ttfa", "rtf", "audio-s", "stalls"]) $(id).textContent = "\u2013";
  $("bytes").textContent = "0";
  setStatus("sending\u2026");
  let bytes = 0;
  try {
    audio = audio || new AudioContext();
    await audio.resume();
    const t0 = performance.now();
    const r = await fetch("/v1/audio/speech", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
      signal: request.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.statusText } }));
      throw new Error(`${r.status}: ${err.error.message}`);
    }
    const reader = r.body.getReader();
    let ttfa = null, samples = 0, stalls = 0, playAt = 0, rest = new Uint8Array(0);
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      if (ttfa === null) {
        ttfa = performance.now() - t0;
        $("ttfa").textContent = `${ttfa.toFixed(0)} ms`;
        setStatus("playing while it streams\u2026");
      }
      bytes += value.length;
      $("bytes").textContent = String(bytes);
      const joined = new Uint8Array(rest.length + value.length);
      joined.set(rest);
      joined.set(value, rest.length);
      const [chunk, left] = toSamples(joined);
      rest = left;
      if (chunk.length === 0) continue;
      samples += chunk.length;
      const buffer = audio.createBuffer(1, chunk.length, sampleRate);
      buffer.copyToChannel(chunk, 0);
      const source = audio.createBufferSource();
      source.buffer = buffer;
      source.connect(audio.destination);
      source.onended = () => played(source);
      sources.push(source);
      if (playAt > 0 && playAt < audio.currentTime) stalls += 1;  // playback caught up with generation: a gap
      playAt = Math.max(playAt, audio.currentTime + 0.02);
      source.start(playAt);
      playAt += buffer.duration;
    }
    const totalS = (performance.now() - t0) / 1000;
    const audioS = samples / sampleRate;
    const rtf = audioS > 0 ? totalS / audioS : NaN;
    $("rtf").textContent = rtf.toFixed(3);
    $("audio-s").textContent = `${audioS.toFixed(2)} s`;
    $("stalls").textContent = String(stalls);
    addRow([text, body.voice || "", ttfa.toFixed(0), rtf.toFixed(3), audioS.toFixed(2), String(stalls)]);
    setStatus(`done: ${bytes} bytes in ${totalS.toFixed(2)} s`);
  } catch (e) {
    if (e.name === "AbortError") setStatus(`stopped after ${bytes} bytes`);
    else setStatus(String(e.message || e), true);
  } finally {
    request = null;
    if (sources.length === 0) $("stop").disabled = true;
    $("play").disabled = false;
  }
}

$("play").addEventListener("click", play);
$("stop").addEventListener("click", stop);
loadModel().catch((e) => setStatus(`cannot read /v1/models: ${e}`, true));
