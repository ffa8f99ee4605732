// GeoMesh-P2P status page. Every value that comes from a record is written with textContent (never
// innerHTML): a device name such as <img src=x onerror=...> shows as text.
(function () {
  "use strict";
  var REFRESH_MS = 2000;
  var state = { updates: 0, swarm: null, rounds: null, charts: {}, errors: 0 };
  window.geomesh = state;

  function $(id) { return document.getElementById(id); }
  function setText(id, text) { $(id).textContent = text; }
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "–" : String(text);
    if (cls) td.className = cls;
    tr.appendChild(td);
    return td;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }
  function ago(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return fmt(s, 0) + " s ago";
    if (s < 3600) return fmt(s / 60, 0) + " min ago";
    return fmt(s / 3600, 1) + " h ago";
  }

  function renderSwarm(v) {
    setText("run-id", v.run_id || "?");
    setText("round", v.round === null ? "–" : String(v.round));
    setText("leader", v.leader || "–");
    var peers = v.peers || [];
    var counts = {};
    peers.forEach(function (p) { counts[p.state] = (counts[p.state] || 0) + 1; });
    setText("peer-count", String(peers.length));
    setText("peer-states", Object.keys(counts).sort().map(function (k) { return counts[k] + " " + k; }).join(", "));
    var d = v.digests;
    var dEl = $("digests");
    if (!d || !d.total) { dEl.textContent = "–"; dEl.className = "value"; setText("digest-detail", ""); }
    else {
      dEl.textContent = d.equal ? "equal" : "differ";
      dEl.className = "value " + (d.equal ? "ok" : "bad");
      setText("digest-detail", d.agree + "/" + d.total + " peers at round " + d.round + " hold " + (d.majority || "?"));
    }
    var plan = v.plan;
    setText("plan-line", plan ? ("plan of round " + plan.round + " by leader " + plan.leader + ": " +
      plan.assignments.length + " participant(s), window " + fmt(plan.window_s, 1) + " s, method " +
      plan.method + ", mode " + plan.mode) : "no plan read for the current round yet");
    var tbody = $("peers").tBodies[0];
    var rows = document.createDocumentFragment();
    peers.forEach(function (p) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-peer", p.short);
      tr.title = p.peer_id + (p.address ? " @ " + p.address : " (client-only)") + ", v" + p.version +
        (p.digest ? ", digest " + p.digest : "");
      cell(tr, p.short, "mono");
      cell(tr, p.device, "device");
      cell(tr, fmt(p.memory_gib, 2), "num");
      cell(tr, fmt(p.tokens_per_s, 0), "num");
      cell(tr, fmt(p.up_mbps, 1), "num");
      cell(tr, fmt(p.down_mbps, 1), "num");
      cell(tr, p.round, "num");
      var st = cell(tr, "");
      var badge = document.createElement("span");
      badge.className = "state state-" + String(p.state).replace(/[^a-z-]/g, "");
      badge.textContent = p.state;
      st.textContent = "";
      st.appendChild(badge);
      // what "training" alone hid from a fresh user (session 51): it ran another plan, or announces a mark on itself
      var notes = [];
      if (p.other_plan) notes.push("other plan r" + p.last_round);
      if (p.marked_until !== null && p.marked_until !== undefined) notes.push("no lead to r" + p.marked_until);
      if (notes.length) {
        var note = document.createElement("span");
        note.className = p.other_plan ? "bad" : "";
        note.textContent = " " + notes.join(", ");
        st.appendChild(note);
      }
      cell(tr, p.batch === null ? "–" : p.batch + " / " + p.inner_steps, "num");
      cell(tr, ago(p.last_seen_s), "num");
      rows.appendChild(tr);
    });
    tbody.replaceChildren(rows);
    setText("ignored", v.ignored ? v.ignored + " record(s) ignored (other run config, no proof of work, or not allowed)" : "");
    var err = v.error ? " — last read failed: " + v.error : "";
    setText("conn", "updated " + new Date((v.updated || v.time) * 1000).toLocaleTimeString() + err);
  }

  function series(label, color, extra) {
    var s = { label: label, stroke: color, width: 2, points: { show: true, size: 5, fill: color } };
    for (var k in extra || {}) s[k] = extra[k];
    return s;
  }

  function chartSpec(id, yLabel, seriesList, logY) {
    var el = $(id);
    var width = Math.max(320, el.clientWidth - 16);
    var opts = {
      width: width, height: 220, legend: { show: true },
      scales: { x: { time: true }, y: logY ? { distr: 3 } : { auto: true } },
      axes: [{}, { label: yLabel, size: 60 }],
      series: [{}].concat(seriesList),
    };
    return opts;
  }

  var CHARTS = {
    "chart-loss": { y: "loss", series: [series("loss (median of peers)", "#2563eb")], pick: function (r) { return [r.loss]; } },
    "chart-ppl": { y: "perplexity", log: true, series: [series("eval perplexity", "#9333ea")], pick: function (r) { return [r.eval_ppl]; } },
    "chart-tps": { y: "tokens/s", series: [series("tokens/s", "#059669")], pick: function (r) { return [r.tokens_per_s]; } },
    "chart-idle": { y: "%", series: [series("straggler idle %", "#d97706"), series("network idle %", "#dc2626")],
                    pick: function (r) { return [r.straggler_idle_pct, r.network_idle_pct]; } },
  };

  function renderRounds(v) {
    var rounds = (v && v.rounds) || [];
    $("no-rounds").style.display = rounds.length ? "none" : "";
    Object.keys(CHARTS).forEach(function (id) {
      var c = CHARTS[id];
      var xs = [], ys = c.series.map(function () { return []; });
      // x must grow: order by the time a round ended (a peer catching up reports late rounds late)
      rounds.slice().sort(function (a, b) { return a.time - b.time; }).forEach(function (r) {
        var vals = c.pick(r);
        if (vals.every(function (x) { return x === null || x === undefined; })) return;
        if (c.log && !(vals[0] > 0)) return;
        if (xs.length && r.time <= xs[xs.length - 1]) return;
        xs.push(r.time);
        vals.forEach(function (x, i) { ys[i].push(x === undefined ? null : x); });
      });
      var data = [xs].concat(ys);
      if (!state.charts[id]) {
        if (!xs.length || typeof uPlot === "undefined") return;
        state.charts[id] = new uPlot(chartSpec(id, c.y, c.series, c.log), data, $(id));
      } else {
        state.charts[id].setData(data);
      }
    });
    var tbody = $("rounds").tBodies[0];
    var frag = document.createDocumentFragment();
    rounds.slice(-12).reverse().forEach(function (r) {
      var tr = document.createElement("tr");
      cell(tr, r.round, "num");
      cell(tr, r.peers, "num");
      var ld = cell(tr, r.leaders > 1 ? r.leader + " +" + (r.leaders - 1) + " SPLIT" : r.leader, "mono");
      if (r.leaders > 1) ld.className += " bad";  // the reporters ran several leaders' plans
      cell(tr, fmt(r.loss, 3), "num");
      cell(tr, fmt(r.eval_ppl, 2), "num");
      cell(tr, fmt(r.tokens_per_s, 0), "num");
      cell(tr, fmt(r.straggler_idle_pct, 1), "num");
      cell(tr, fmt(r.network_idle_pct, 1), "num");
      cell(tr, fmt(r.bytes_sent_per_peer / 1024, 1), "num");
      var d = cell(tr, r.digest_agree === true ? "equal" : r.digest_agree === false ? "MISMATCH" : "–");
      d.className = r.digest_agree === true ? "ok" : r.digest_agree === false ? "bad" : "";
      frag.appendChild(tr);
    });
    tbody.replaceChildren(frag);
    var last = null;
    for (var i = rounds.length - 1; i >= 0; i--) if (rounds[i].eval_ppl !== null && rounds[i].eval_ppl !== undefined) { last = rounds[i]; break; }
    setText("last-ppl", last ? fmt(last.eval_ppl, 2) : "–");
    setText("last-loss", rounds.length ? "loss " + fmt(rounds[rounds.length - 1].loss, 3) + " at round " + rounds[rounds.length - 1].round : "");
  }

  function getJSON(url) {
    return fetch(url, { cache: "no-store" }).then(function (r) {
      if (!r.ok) throw new Error(url + ": HTTP " + r.status);
      return r.json();
    });
  }

  function tick() {
    Promise.all([getJSON("/api/swarm"), getJSON("/api/rounds")]).then(function (res) {
      state.swarm = res[0]; state.rounds = res[1];
      renderSwarm(res[0]);
      renderRounds(res[1]);
      state.updates += 1;
    }).catch(function (e) {
      state.errors += 1;
      setText("conn", "cannot reach the bootstrap (" + e.message + "); retrying");
    }).then(function () { setTimeout(tick, REFRESH_MS); });
  }

  window.addEventListener("resize", function () {
    Object.keys(state.charts).forEach(function (id) {
      state.charts[id].setSize({ width: Math.max(320, $(id).clientWidth - 16), height: 220 });
    });
  });
  tick();
})();
