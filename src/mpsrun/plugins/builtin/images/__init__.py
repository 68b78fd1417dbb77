"""Your own images: `image_folder` and `image_csv`, decoded once into a uint8 cache.

`scan` lists the files and labels (and refuses bad layouts before anything heavy), `cache`
keys, builds and reopens the memory-mapped cache, `decode` (PIL in worker processes) and
`gpu_decode` (nvJPEG) fill it, `datasets` is the two plugins. Augmentation is the recipe's
`augment:` list, run on the device by the training loop (`mpsrun.train.loop.augment`).
"""
