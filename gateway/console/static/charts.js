// Small line charts in SVG, drawn by hand: no library. A chart is the page's
// <template id="chart-template"> cloned (its <svg> gives the SVG namespace, so nothing here
// names a URL); its lines are scaled to the box (preserveAspectRatio none, strokes that do
// not scale: console.css), its labels are HTML around it. Colours come from the stylesheet
// (light and dark), and each chart says in words what it shows (role="img", aria-label).

const WIDTH = 100; // the viewBox: x in 0..100, y in 0..HEIGHT (0 at the top)
const HEIGHT = 40;
const TOP = 3; // room above the highest value

// A round number at or above `value`: 1, 2 or 5 times a power of ten.
export function niceCeiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 5, 10]) {
    if (value <= step * power) return step * power;
  }
  return 10 * power;
}

function svgElement(svg, tag, attributes) {
  const node = document.createElementNS(svg.namespaceURI, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

// The unbroken runs of a series: [[x, y], ...] per run; a null value ends a run.
function runs(series, from, to, ceiling) {
  const found = [];
  let run = [];
  const span = Math.max(1, to - from);
  series.times.forEach((time, i) => {
    const value = series.values[i];
    if (value == null || time < from) {
      if (run.length) found.push(run);
      run = [];
      return;
    }
    const x = ((time - from) / span) * WIDTH;
    const y = HEIGHT - (Math.min(value, ceiling) / ceiling) * (HEIGHT - TOP);
    run.push([x, y]);
  });
  if (run.length) found.push(run);
  return found;
}

function points(run) {
  // One point alone: a short dash, so it shows.
  const shown = run.length === 1 ? [[run[0][0] - 0.6, run[0][1]], [run[0][0] + 0.6, run[0][1]]] : run;
  return shown.map(([x, y]) => `${x.toFixed(2)},${y.toFixed(2)}`).join(" ");
}

function last(values) {
  for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] != null) return values[i];
  return null;
}

// A new, empty chart: { node, draw(options) }.
export function chart(title, legend = []) {
  const node = document.getElementById("chart-template").content.firstElementChild.cloneNode(true);
  node.querySelector(".chart-title").textContent = title;
  const keys = node.querySelector(".chart-legend");
  for (const [label, cls] of legend) {
    const key = document.createElement("span");
    key.className = `key ${cls}`;
    key.textContent = label;
    keys.append(key);
  }
  return {
    node,
    // series: [{ times, values, cls, label }]; from/to: the time axis (ms); format(value);
    // axis(value): the top of the scale, short; ceiling(value): a round top for the scale.
    draw({ series, from, to, format, fromLabel, axis = format, ceiling: roundUp = niceCeiling }) {
      const svg = node.querySelector("svg");
      const values = series.flatMap((s) => s.values.filter((v, i) => v != null && s.times[i] >= from));
      const ceiling = roundUp(Math.max(0, ...values));
      const grid = [svgElement(svg, "line", { x1: 0, x2: WIDTH, y1: TOP, y2: TOP, class: "grid" })];
      grid.push(svgElement(svg, "line", { x1: 0, x2: WIDTH, y1: HEIGHT, y2: HEIGHT, class: "axis" }));
      const drawn = [];
      series.forEach((s, i) => {
        for (const run of runs(s, from, to, ceiling)) {
          if (i === 0 && run.length > 1) {
            const area = [[run[0][0], HEIGHT], ...run, [run[run.length - 1][0], HEIGHT]];
            drawn.push(svgElement(svg, "polygon", { points: points(area), class: `area ${s.cls}` }));
          }
          drawn.push(svgElement(svg, "polyline", { points: points(run), class: `line ${s.cls}` }));
        }
      });
      svg.replaceChildren(...grid, ...drawn);
      node.querySelector(".chart-max").textContent = axis(ceiling);
      node.querySelector(".chart-from").textContent = fromLabel;
      const now = series.map((s) => [s.label, last(s.values)]);
      const said = now.map(([label, value]) => `${label ? `${label} ` : ""}${value == null ? "no data" : format(value)}`);
      node.querySelector(".chart-now").textContent = said.join(" · ");
      const highest = values.length ? format(Math.max(...values)) : null;
      svg.setAttribute(
        "aria-label",
        values.length
          ? `${title}, ${fromLabel} to now: latest ${said.join(", ")}; highest ${highest}`
          : `${title}, ${fromLabel} to now: no data yet`,
      );
      node.classList.toggle("empty", !values.length);
    },
  };
}
