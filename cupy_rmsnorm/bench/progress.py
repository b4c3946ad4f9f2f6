"""A dependency-free progress bar on stderr.

On a terminal it redraws one line; into a file or a pipe it writes a line at every
tenth of the way, so logs stay short.
"""

import shutil
import sys
import time


def format_duration(seconds):
    seconds = max(0, int(round(seconds)))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    def __init__(self, total, stream=None, width=24, tty=None, clock=time.monotonic):
        self.total = max(0, int(total))
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.label = ""
        self._last_tenth = 0
        self._drawn = False

    def line(self):
        """The bar as text: ``[#####-----]  12/40  30%  0:41 left  label``."""
        frac = self.done / self.total if self.total else 1.0
        filled = int(frac * self.width)
        elapsed = self.clock() - self.start
        if self.done and self.done < self.total:
            eta = f"{format_duration(elapsed / self.done * (self.total - self.done))} left"
        else:
            eta = f"{format_duration(elapsed)} elapsed"
        bar = "#" * filled + "-" * (self.width - filled)
        return f"[{bar}] {self.done:>{len(str(self.total))}}/{self.total} {frac:4.0%}  {eta}  {self.label}"

    def update(self, label):
        """Show what is being measured now (without advancing)."""
        self.label = label
        if self.tty:
            self._draw()

    def advance(self, steps=1, label=None):
        self.done = min(self.total, self.done + steps)
        if label is not None:
            self.label = label
        if self.tty:
            self._draw()
        else:
            tenth = int(10 * self.done / self.total) if self.total else 10
            if tenth > self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(self.line().rstrip() + "\n")
                self.stream.flush()

    def write(self, message):
        """A line of text above the bar (which a terminal then redraws)."""
        if self.tty and self._drawn:
            cols = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (cols - 1) + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()
        if self.tty and self._drawn:
            self._draw()

    def _draw(self):
        cols = shutil.get_terminal_size((100, 20)).columns
        text = self.line()[: cols - 1]
        self.stream.write("\r" + text.ljust(cols - 1))
        self.stream.flush()
        self._drawn = True

    def close(self):
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
