"""A background thread that produces item k+1 while the caller works on item k.

The thread holds only the producer function, a queue and a stop flag, never the Prefetcher or its
owner, so dropping the owner lets the garbage collector stop the thread (weakref.finalize).
"""
import queue
import threading
import weakref

DEPTH = 2        # items produced ahead
POLL = 0.1       # seconds between checks of the stop flag while blocked


class Prefetcher:
    """Yields produce(start), produce(start + 1), ... from a daemon thread.

    An exception raised by `produce` (any, SystemExit included: a thread that died silently
    would leave get() nothing to say) is re-raised, as the same object, by the get() that would
    have returned its item (and by every get() after it); the thread then ends.
    """

    def __init__(self, produce, start=0, depth=DEPTH, name="prefetch"):
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error = None
        self.thread = threading.Thread(target=_run, args=(produce, start, self._queue, self._stop),
                                       name=name, daemon=True)
        self.thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self.thread, self._stop, self._queue)

    def get(self):
        """The next item, blocking until the thread has made it."""
        if self._error is not None:
            raise self._error
        while True:
            try:
                item, error = self._queue.get(timeout=POLL)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self._queue.empty():
                    raise RuntimeError("prefetch thread stopped without an item") from None
        if error is not None:
            self._error = error
            raise error
        return item

    def close(self):
        """Stop the thread and wait for it; safe to call more than once."""
        self._finalizer()


def _run(produce, index, items, stop):
    while not stop.is_set():
        try:
            entry = (produce(index), None)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            entry = (None, exc)
        while not stop.is_set():
            try:
                items.put(entry, timeout=POLL)
                break
            except queue.Full:
                continue
        if entry[1] is not None:
            return
        index += 1


def _shutdown(thread, stop, items):
    stop.set()
    while True:
        try:
            items.get_nowait()
        except queue.Empty:
            break
    if thread is not threading.current_thread():
        thread.join()
