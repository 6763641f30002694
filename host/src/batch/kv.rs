//! The paged KV cache's allocator: fixed-size blocks from one pool, a block table per sequence.
//!
//! Blocks are reference-counted so that sequences with a common prefix can hold the same
//! blocks (a prefix cache); a block goes back to the pool when its last holder lets go.
//! The storage the ids index is the backend's.

/// The pool of KV blocks, by id `0..total`.
pub struct BlockPool {
    /// Holders of each block; 0: free.
    refs: Vec<u32>,
    /// Free ids, taken from the end: the lowest come out first and a freed one is reused
    /// first, so storage that grows to the highest id used (the CPU's) stays small.
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(blocks: usize) -> BlockPool {
        BlockPool {
            refs: vec![0; blocks],
            free: (0..blocks as u32).rev().collect(),
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// Appends `n` fresh blocks to `table`; false (and nothing taken) if fewer are free.
    pub fn alloc(&mut self, table: &mut Vec<u32>, n: usize) -> bool {
        if n > self.free.len() {
            return false;
        }
        for b in self.free.drain(self.free.len() - n..).rev() {
            self.refs[b as usize] = 1;
            table.push(b);
        }
        true
    }

    /// One more holder of the (held) `block`: a sequence that shares it.
    pub fn share(&mut self, block: u32) {
        assert!(self.refs[block as usize] > 0, "block {block} is free");
        self.refs[block as usize] += 1;
    }

    /// Lets go of every block of `table` and empties it; a block nobody holds any more is free.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        // In reverse, so that the table's first block is the next one out.
        for b in table.drain(..).rev() {
            let r = &mut self.refs[b as usize];
            assert!(*r > 0, "block {b} released twice");
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_and_go() {
        let mut pool = BlockPool::new(4);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.alloc(&mut a, 3));
        assert_eq!(a, [0, 1, 2]);
        // Not enough: nothing is taken.
        assert!(!pool.alloc(&mut b, 2));
        assert!(b.is_empty());
        assert_eq!((pool.used(), pool.free()), (3, 1));
        assert!(pool.alloc(&mut b, 1));
        assert_eq!(b, [3]);
        assert_eq!(pool.free(), 0);
        pool.release(&mut a);
        assert!(a.is_empty());
        assert_eq!((pool.used(), pool.free(), pool.total()), (1, 3, 4));
        // Freed blocks are reused, lowest first.
        assert!(pool.alloc(&mut a, 2));
        assert_eq!(a, [0, 1]);
    }

    #[test]
    fn shared_blocks_stay_until_the_last_holder_lets_go() {
        let mut pool = BlockPool::new(3);
        let mut a = Vec::new();
        assert!(pool.alloc(&mut a, 2));
        // `b` shares `a`'s first block (a common prefix) and has one of its own.
        pool.share(a[0]);
        let mut b = vec![a[0]];
        assert!(pool.alloc(&mut b, 1));
        assert_eq!(b, [0, 2]);
        pool.release(&mut a);
        assert_eq!(pool.used(), 2, "block 0 is still b's");
        pool.release(&mut b);
        assert_eq!(pool.used(), 0);
        assert!(pool.alloc(&mut a, 3));
    }

    #[test]
    #[should_panic(expected = "released twice")]
    fn double_release_panics() {
        let mut pool = BlockPool::new(2);
        let mut a = Vec::new();
        assert!(pool.alloc(&mut a, 1));
        let mut again = a.clone();
        pool.release(&mut a);
        pool.release(&mut again);
    }
}
