"""Process helpers that know nothing of RL: asyncio, atomic files, fault injection, graceful stop,
import timing and the metrics logger."""
