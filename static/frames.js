// Animation frames the page does not need. Gradio 6 (6.31 measured) leaves two animation loops running
// for as long as a page is open: the status tracker shown while the app loads is removed with its
// elapsed-time timer still requesting a frame each time, and a loading spinner's spring keeps Svelte's
// animation loop going. Each frame restyles and repaints: about 10 % of one core for an idle page
// (Chromium's CPU time, measured), and on a 2-core machine a frame every 16 ms lands in a decode step
// every fourth token. This script, loaded before the page's own, lets animations run as they are,
// slows any loop that has asked for a frame continuously for LOOP_AFTER_MS to one frame every
// LOOP_EVERY_MS (a spinner still turns, slowly), and stopLeaked() ends the timer loop that outlived
// its tracker (phasescope.js calls it once the page is up).
(() => {
  const LOOP_AFTER_MS = 2000;
  const LOOP_EVERY_MS = 250;
  const nativeRequest = window.requestAnimationFrame.bind(window);
  const nativeCancel = window.cancelAnimationFrame.bind(window);
  const loops = new WeakMap();  // callback -> {since, last}: when it began asking every frame, and last asked
  const throttled = new Map();  // our id (negative) -> the timeout that will request its frame
  const recent = [];  // the ids of the frames requested through here lately
  let nextId = -1;

  function request(callback) {
    const id = nativeRequest(callback);
    recent.push(id);
    if (recent.length > 512) recent.shift();
    return id;
  }

  window.requestAnimationFrame = (callback) => {
    const now = performance.now();
    const loop = loops.get(callback);
    if (!loop || now - loop.last > 2 * LOOP_EVERY_MS) {
      loops.set(callback, {since: now, last: now});
      return request(callback);
    }
    loop.last = now;
    if (now - loop.since < LOOP_AFTER_MS) return request(callback);
    const id = nextId--;
    throttled.set(id, setTimeout(() => {
      throttled.delete(id);
      request(callback);
    }, LOOP_EVERY_MS));
    return id;
  };

  window.cancelAnimationFrame = (id) => {
    if (throttled.has(id)) {
      clearTimeout(throttled.get(id));
      throttled.delete(id);
    } else {
      nativeCancel(id);
    }
  };

  // Cancel the frames requested lately by code that took requestAnimationFrame before this script ran
  // (Gradio's status tracker keeps its own reference): once the page is up, that is the leaked timer.
  function stopLeaked() {
    const last = nativeRequest(() => {});
    const ours = new Set(recent);
    for (let id = Math.max(1, last - 256); id < last; id++) if (!ours.has(id)) nativeCancel(id);
    nativeCancel(last);
  }

  window.phasescopeFrames = {stopLeaked};
})();
