"""Image-video joint training, as Sana's ivjoint trainer schedules it: most steps are video batches, every
`interval`-th step is a whole batch of images (one-frame latents of the same VAE) at its own batch size.

Sana decides before each step from the steps done so far (its `global_step`): with `interval` > 0, the step
taken after n steps is an image step when n is a positive multiple of `interval` (so steps interval + 1,
2 * interval + 1, ... counted from 1); 0 turns joint training off. Each source has its own deterministic,
resumable loader (sana2/data/loader.py); their positions and the step counters are this loader's state, so
a run resumes exactly, at another data-parallel size too (the global batch sizes stay the same).
"""

from sana2.data.loader import DistributedFeatureLoader


def is_image_step(steps_done: int, interval: int) -> bool:
    """Whether the step after `steps_done` steps is an image step of Sana's joint schedule."""
    return interval > 0 and steps_done > 0 and steps_done % interval == 0


class JointLoader:
    """The joint schedule over a video loader and an image loader; read like a DistributedFeatureLoader."""

    def __init__(self, video: DistributedFeatureLoader, image: DistributedFeatureLoader, interval: int):
        if interval < 1:
            raise ValueError(f"joint_training_interval must be positive for joint training, got {interval}")
        self.video, self.image, self.interval = video, image, interval
        self.steps = self.video_steps = self.image_steps = 0

    @property
    def epoch(self) -> int:
        """The video data's epoch (what a run's epochs count, as in Sana)."""
        return self.video.epoch

    @property
    def global_batch_size(self) -> int:
        return self.video.global_batch_size

    def next_is_image(self) -> bool:
        return is_image_step(self.steps, self.interval)

    def step_indices(self):
        return (self.image if self.next_is_image() else self.video).step_indices()

    def next_step(self):
        """This rank's micro-batches of the next step (video or image), then advance."""
        if self.next_is_image():
            batches = self.image.next_step()
            self.image_steps += 1
        else:
            batches = self.video.next_step()
            self.video_steps += 1
        self.steps += 1
        return batches

    def state_dict(self) -> dict:
        return {
            "video": self.video.state_dict(),
            "image": self.image.state_dict(),
            "interval": self.interval,
            "steps": self.steps,
            "video_steps": self.video_steps,
            "image_steps": self.image_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if "video" not in state or "image" not in state:
            raise ValueError("data loader state has no joint schedule (saved without joint training)")
        if int(state["interval"]) != self.interval:
            raise ValueError(
                f"data loader state was saved with joint_training_interval {state['interval']}, this run uses "
                f"{self.interval}; resuming needs the same schedule"
            )
        self.video.load_state_dict(state["video"])
        self.image.load_state_dict(state["image"])
        self.steps, self.video_steps, self.image_steps = (
            int(state[k]) for k in ("steps", "video_steps", "image_steps")
        )
