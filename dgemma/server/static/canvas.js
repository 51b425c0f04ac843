// The canvas view: every position of the current canvas as it changes (accepted by the step / unchanged /
// changed), the step counter, the committed text above it, a stats row per committed canvas, and the replay
// of a recorded answer.

// A position's text, made visible: empty -> ∅, newline -> ↵, tab -> →, only spaces -> ␣.
export function shown(piece) {
  if (piece === "") return "∅";
  const text = piece.replace(/\n/g, "↵").replace(/\t/g, "→");
  return /^ +$/.test(text) ? "␣".repeat(text.length) : text;
}

export class CanvasView {
  // els: {grid, counter, committed, stats (a tbody), usage}
  constructor(els) {
    this.els = els;
    this.cells = [];
    this.clear();
  }

  setLength(n) {
    while (this.cells.length < n) {
      const cell = document.createElement("span");
      cell.className = "tok cut";
      cell.textContent = "·";
      this.els.grid.append(cell);
      this.cells.push(cell);
    }
  }

  clear() {
    this.committed = "";
    this.last = null;
    this.els.committed.textContent = "";
    this.els.stats.replaceChildren();
    this.els.usage.textContent = "";
    this.els.counter.textContent = "idle";
    for (const cell of this.cells) {
      cell.className = "tok cut";
      cell.textContent = "·";
    }
  }

  // A new answer starts at time t (ms); maxSteps is shown in the counter.
  start(t, maxSteps) {
    this.clear();
    this.canvasStart = t;
    this.maxSteps = maxSteps;
    this.els.counter.textContent = "waiting for the first step…";
  }

  // One denoising step's draft {canvas, step, token_ids, tokens, accepted}, seen at time t.
  draft(d, t) {
    if (this.last && d.canvas !== this.last.canvas) this.closeCanvas();
    const prev = this.last;
    const ids = d.token_ids;
    this.setLength(ids.length);
    let kept = 0;
    this.cells.forEach((cell, i) => {
      let text = "·", kind = "cut";
      if (i < ids.length) {
        text = shown(d.tokens[i] ?? String(ids[i]));
        kind = d.accepted[i] ? "acc" : prev && prev.token_ids[i] === ids[i] ? "stable" : "noisy";
        kept += d.accepted[i] ? 1 : 0;
      }
      if (cell.textContent !== text) cell.textContent = text;
      cell.className = `tok ${kind}`;
    });
    const of = this.maxSteps ? `/${this.maxSteps}` : "";
    this.els.counter.textContent = `canvas ${d.canvas + 1} · step ${d.step}${of} · ${kept}/${ids.length} kept`;
    this.last = d;
    this.lastT = t;
  }

  text(delta) {
    this.committed += delta;
    this.els.committed.textContent = this.committed;
    this.els.committed.scrollTop = this.els.committed.scrollHeight;
  }

  // The answer ended: the last canvas committed. usage: the API's usage object, or null.
  finish(usage, seconds) {
    const drafted = this.last !== null || this.els.stats.rows.length > 0;
    if (this.last) this.closeCanvas();
    const counter = this.els.counter;
    counter.textContent = drafted ? `${counter.textContent} · done` : "done · the server sent no drafts";
    if (usage) {
      this.els.usage.textContent = `· ${usage.completion_tokens} tokens in ${seconds.toFixed(2)} s`;
    }
  }

  stopped() {
    this.els.counter.textContent += " · stopped";
  }

  closeCanvas() {
    const d = this.last, steps = d.step, tokens = d.token_ids.length;
    const row = document.createElement("tr");
    const cells = [d.canvas + 1, steps, tokens, (tokens / steps).toFixed(2),
                   ((this.lastT - this.canvasStart) / 1000).toFixed(3)];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = String(value);
      row.append(td);
    }
    this.els.stats.append(row);
    this.canvasStart = this.lastT;
    this.last = null;
  }

  // One recorded event: {kind: "start", t, maxSteps} | {kind: "draft", draft, t} | {kind: "text", text} |
  // {kind: "finish", usage, seconds} | {kind: "stopped"}. The live answer and its replay both come through here.
  apply(e) {
    if (e.kind === "start") this.start(e.t, e.maxSteps);
    else if (e.kind === "draft") this.draft(e.draft, e.t);
    else if (e.kind === "text") this.text(e.text);
    else if (e.kind === "finish") this.finish(e.usage, e.seconds);
    else if (e.kind === "stopped") this.stopped();
  }

  // Play recorded events back: speed "real" keeps the recorded pace, a number is steps per second. Calls done()
  // at the end; returns a function that cancels (and also calls done()).
  replay(events, speed, done) {
    let i = 0, timer = null;
    const step = () => {
      while (i < events.length) {
        const e = events[i++];
        this.apply(e);
        if (e.kind !== "draft") continue;
        let j = i;
        while (j < events.length && events[j].kind !== "draft") j++;
        if (j < events.length) {
          timer = setTimeout(step, speed === "real" ? Math.min(events[j].t - e.t, 2000) : 1000 / Number(speed));
          return;
        }
      }
      timer = null;
      done();
    };
    step();
    return () => {
      clearTimeout(timer);
      done();
    };
  }
}
